"""The table of every supported config key and its default, read off the schema, so the
configuration reference, docs/reference/config.md, is generated, not copied
(scripts/update_docs_tables.py; tests/docs/test_config_reference.py checks it)."""

import types
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from shardwise.frontends.deepspeed.config.fields import Section
from shardwise.frontends.deepspeed.config.params import OPTIMIZER_PARAMS, SCHEDULER_PARAMS
from shardwise.frontends.deepspeed.config.schema import OptimizerConfig, SchedulerConfig, ShardwiseConfig


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The model class inside a field annotation such as `ZeroConfig` or `AioConfig | None`."""
    candidates = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def default_config_table() -> list[tuple[str, object]]:
    """(dotted key, default) for every supported key, so documentation is generated, not copied.

    Optimizer and scheduler params are listed per type as `optimizer.params[Adam|AdamW].lr`;
    defaults that depend on other keys are given as a short description.
    """
    rows: list[tuple[str, object]] = []
    _collect_defaults(ShardwiseConfig, "", rows)
    return rows


def _collect_defaults(model: type[BaseModel], prefix: str, rows: list[tuple[str, object]]) -> None:
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        nested = section_model(field.annotation)
        if nested is not None:
            if not field.is_required() and field.get_default(call_default_factory=True) is None:
                rows.append((key, None))
            _collect_defaults(nested, f"{key}.", rows)
        elif model is OptimizerConfig and name == "params":
            _collect_params(OPTIMIZER_PARAMS, prefix, rows)
        elif model is SchedulerConfig and name == "params":
            _collect_params(SCHEDULER_PARAMS, prefix, rows)
        else:
            rows.append((key, _documented_default(field)))


def _collect_params(by_type: dict[str, type[Section]], prefix: str, rows: list[tuple[str, object]]) -> None:
    type_names_by_model: dict[type[Section], list[str]] = {}
    for type_name, model in by_type.items():
        type_names_by_model.setdefault(model, []).append(type_name)
    for model, type_names in type_names_by_model.items():
        for name, field in model.model_fields.items():
            rows.append((f"{prefix}params[{'|'.join(type_names)}].{name}", _documented_default(field)))


def _documented_default(field: FieldInfo) -> object:
    extra = field.json_schema_extra
    if isinstance(extra, dict) and "default_doc" in extra:
        return extra["default_doc"]
    if field.is_required():
        return "required"
    return field.get_default(call_default_factory=True)
