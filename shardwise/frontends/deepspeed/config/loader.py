"""`load_config`: from a DeepSpeed-format dict or JSON file to a resolved `ShardwiseConfig`.

The passes run in a fixed order and each adds to one list of problems instead of
raising, so a config with several mistakes is reported whole: keys, then "auto",
then batch sizes, then optimizer and scheduler params, then types and ranges
(pydantic), then capabilities and contradictions, which need all values valid.
"""

import base64
import copy
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from shardwise.frontends.deepspeed.config.checks import (
    find_contradictions,
    find_data_types_contradictions,
    find_ignored,
    find_unsupported,
)
from shardwise.frontends.deepspeed.config.errors import ConfigError, describe_validation_error
from shardwise.frontends.deepspeed.config.keys import check_keys, expand_dotted_keys
from shardwise.frontends.deepspeed.config.params import resolve_params
from shardwise.frontends.deepspeed.config.resolve import (
    BATCH_KEYS,
    batch_left_to_auto,
    fill_auto,
    keep_global_batch,
    resolve_auto,
    resolve_batch,
    resolve_data_parallel_size,
)
from shardwise.frontends.deepspeed.config.schema import ShardwiseConfig

log = logging.getLogger("shardwise")


def load_config(
    config: Mapping[str, Any] | str | os.PathLike[str], world_size: int, hidden_size: int | None = None,
    auto_values: Mapping[str, Any] | None = None,
) -> ShardwiseConfig:
    """Validate and resolve a DeepSpeed-format config.

    `world_size` is the number of processes; the batch arithmetic uses the data-parallel
    size, world_size / (tensor_parallel.size * sequence_parallel.size * pipeline_parallel.size)
    (see `data_parallel_size`). `hidden_size`, when the
    model has one, sizes "auto" buckets as Hugging Face's DeepSpeed integration does; without
    it they take DeepSpeed's defaults. `auto_values` maps dotted keys to the caller's values
    for keys the config sets to "auto" (the learning rate, step counts, batch sizes...), as
    Hugging Face's trainer fills them. Raises `ConfigError` listing every problem found.
    """
    _require_positive_int("world_size", world_size)
    if hidden_size is not None:
        _require_positive_int("hidden_size", hidden_size)
    problems: list[str] = []
    ignored: list[str] = []
    raw = expand_dotted_keys(read_config(config))
    cleaned = fill_auto(check_keys(raw, problems, ignored), auto_values or {})
    batch_auto = batch_left_to_auto(cleaned)
    resolve_auto(cleaned, hidden_size, problems)
    data_parallel = resolve_data_parallel_size(cleaned, world_size, problems)
    batch_world = None if data_parallel is None else data_parallel * autotp_batch_factor(raw)
    if batch_world is not None:
        keep_global_batch(cleaned, batch_world)
    batch_resolved = batch_world is not None and resolve_batch(
        cleaned, batch_world, problems, world_size, auto=batch_auto
    )
    for block in ("optimizer", "scheduler"):
        _resolve_block_params(cleaned, block, problems)
    # With the batch unresolved (already reported), stand-in sizes let every other check still run;
    # the result is never returned because `problems` is not empty.
    stand_in_batch = {} if batch_resolved else dict.fromkeys(BATCH_KEYS, 1)
    try:
        cfg = ShardwiseConfig.model_validate({**cleaned, **stand_in_batch})
    except ValidationError as error:
        raise ConfigError(problems + describe_validation_error(error)) from None
    problems += find_unsupported(cfg) + find_contradictions(cfg, batch_known=batch_resolved,
                                                            data_parallel_size=data_parallel)
    problems += find_data_types_contradictions(cfg)
    if problems:
        raise ConfigError(problems)
    warn_ignored(ignored + find_ignored(cfg))
    return cfg


def autotp_batch_factor(raw: Mapping[str, Any]) -> int:
    """What DeepSpeed 0.19.8's batch arithmetic multiplies the data-parallel size by: with
    AutoTP (`tensor_parallel.autotp_size`) its config counts every process, tensor-parallel
    ranks too (world / sequence_parallel_size, with no mpu to say otherwise), so the
    Hugging Face Trainer fills `train_batch_size` as micro x accumulation x world, and a
    config written as micro x accumulation x data-parallel size is refused there. The
    engine trains micro x accumulation x data-parallel size samples per step either way;
    `train_batch_size` and `global_samples` count as DeepSpeed's do."""
    block = raw.get("tensor_parallel")
    size = block.get("autotp_size") if isinstance(block, Mapping) else None
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 1 else 1


def warn_ignored(ignored: list[str]) -> None:
    """One warning for every key the config sets that changes nothing here, as DeepSpeed
    runs the same config without complaint (so a user learns once, not per key)."""
    if ignored:
        lines = "\n".join(f"  - {line}" for line in ignored)
        log.warning("shardwise ignores %d config key(s), training is the same without them:\n%s", len(ignored), lines)


def _require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _resolve_block_params(cleaned: dict[str, Any], block: str, problems: list[str]) -> None:
    """Fill in the params of an optimizer or scheduler block whose type check_keys accepted.
    Params that fail validation stay as given: their problems are already reported."""
    section = cleaned.get(block)
    if not isinstance(section, dict) or not isinstance(section.get("type"), str):
        return
    params = section.get("params", {})
    if isinstance(params, Mapping):
        resolved = resolve_params(block, section["type"], dict(params), problems)
        section["params"] = params if resolved is None else resolved


def read_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """The raw config as a dict: a copy of a dict, or a JSON file read strictly (UTF-8, one
    object, no key given twice), with a `ConfigError` naming the file otherwise. A string
    that names no file may be the config itself, base64-encoded (URL-safe alphabet), as
    DeepSpeed accepts it (its autotuner hands configs to its runs that way)."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(f"config must be a dict or the path of a JSON file, got {type(config).__name__}")
    path = Path(config)
    if isinstance(config, str) and not _names_a_file(path):
        encoded = _base64_config(config)
        if encoded is not None:
            return encoded
        raise ConfigError(f"config file {_shortened(config)} does not exist (nor is the text a base64-encoded JSON "
                          "config)")
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory: give the path of the JSON config file inside it")
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset {error.start}): "
            "JSON configs must be UTF-8; save it as UTF-8, or check that the path names the config and not "
            "another file"
        ) from None
    try:
        data = json.loads(text, object_pairs_hook=lambda pairs: _unique_keys(pairs, path))
    except json.JSONDecodeError as error:
        raise ConfigError(f"config file {path} is not valid JSON: {error.msg} at line {error.lineno}, "
                          f"column {error.colno}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a JSON object, not a {type(data).__name__}")
    return data


def _names_a_file(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name too long for the file system: a base64 config, or nothing
        return False


def _shortened(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _base64_config(text: str) -> dict[str, Any] | None:
    """`text` decoded as a base64 (URL-safe) JSON object, else None."""
    try:
        decoded = base64.urlsafe_b64decode(text.encode("ascii")).decode("utf-8")
        data = json.loads(decoded, object_pairs_hook=lambda pairs: _unique_keys(pairs, Path("<base64 config>")))
    except (ValueError, UnicodeError):  # binascii.Error and JSONDecodeError are ValueErrors
        return None
    return data if isinstance(data, dict) else None


def _unique_keys(pairs: list[tuple[str, Any]], path: Path) -> dict[str, Any]:
    """A key given twice would silently keep the last value; DeepSpeed refuses it too."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ConfigError(f"config file {path} sets '{key}' twice in the same object")
        seen[key] = value
    return seen
