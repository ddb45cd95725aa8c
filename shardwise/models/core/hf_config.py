"""Reading a Hugging Face config.json for the planner: the sizes a family's parameter
count needs, each checked (a positive integer; the layout the family defines), with
transformers' defaults for the keys a config may omit. A JSON read: no transformers import."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping


def load_config(path_or_dict: str | Path | Mapping[str, Any]) -> tuple[dict[str, Any], str, str]:
    """(config, the model's name, where the config came from for messages)."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict), "config", "config"
    path = Path(path_or_dict)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no Hugging Face config at {path}")
    try:
        data = path.read_bytes()
        config = json.loads(data.decode("utf-8"))
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}): "
                         "a Hugging Face config.json is UTF-8 JSON; check that the path names one") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config, path.parent.name or str(path), str(path)


def require(config: Mapping[str, Any], key: str, where: str) -> int:
    if config.get(key) is None:
        raise ValueError(f"{where}: config has no {key!r}, needed to count parameters")
    return _count(config, key, where)


def optional(config: Mapping[str, Any], key: str, default: int, where: str) -> int:
    """A key transformers fills in when it is absent or null."""
    return default if config.get(key) is None else _count(config, key, where)


def _count(config: Mapping[str, Any], key: str, where: str) -> int:
    """A size or count from the config; JSON may write it as 64.0, but not as "64", 0 or NaN."""
    value = config[key]
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or value <= 0:
        raise ValueError(f"{where}: {key} is {value!r}, not a positive integer (a size or count of the model); "
                         "correct it in the config")
    return int(value)


def check_divides(whole: tuple[str, int], part: tuple[str, int], why: str, where: str) -> None:
    """A layout the model family does not define (attention splits the width evenly): said before
    counting, rather than counting a model that cannot be meant."""
    if whole[1] % part[1]:
        raise ValueError(f"{where}: {whole[0]} {whole[1]} is not divisible by {part[0]} {part[1]}: {why}; "
                         "correct the config")
