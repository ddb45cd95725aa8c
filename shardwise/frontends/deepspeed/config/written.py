"""DeepSpeed engine accessors of the settings shardwise accepts without modelling them:
each answers the config as the script wrote it, else DeepSpeed 0.19.8's default, as
DeepSpeed's own engine does (its `DeepSpeedConfig` fills the same defaults).

How shardwise treats each key (honoured, accepted as harmless, refused) is
frontends/deepspeed/config/deepspeed_keys.py's; these only let a script that asks its
engine what it was configured with get DeepSpeed's answer.
"""

from __future__ import annotations

from typing import Any, Callable

_ABSENT = object()


def written_value(config: dict[str, Any], path: str, default: Any) -> Any:
    """`config`'s value at the dotted `path`, else `default` (also where a block on the way
    is missing or null)."""
    value: Any = config
    for key in path.split("."):
        value = value.get(key, _ABSENT) if isinstance(value, dict) else _ABSENT
        if value is _ABSENT:
            return default
    return value


def written_setting(path: str, default: Any, *, alias: str | None = None) -> Callable[[Any], Any]:
    """An engine method answering the script's config at `path`, else at DeepSpeed's other
    spelling `alias`, else DeepSpeed's `default`, read from the engine's `script_config`."""

    def accessor(engine: Any) -> Any:
        value = written_value(engine.script_config, path, _ABSENT)
        if value is _ABSENT and alias is not None:
            value = written_value(engine.script_config, alias, _ABSENT)
        return default if value is _ABSENT else value

    accessor.__doc__ = f"The config's `{path}` as written (DeepSpeed's default: {default!r})."
    return accessor


# The optimizer types DeepSpeed 0.19.8's config lower-cases (its runtime/config.py DEEPSPEED_OPTIMIZERS)
DEEPSPEED_OPTIMIZERS = ["adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon"]


def written_optimizer_name(config: dict[str, Any]) -> str | None:
    """The config's `optimizer.type` as DeepSpeed reports it: lower-cased for its own
    optimizers ("adam"), as written for the others."""
    name = written_value(config, "optimizer.type", None)
    return name.lower() if isinstance(name, str) and name.lower() in DEEPSPEED_OPTIMIZERS else name
