"""`deepspeed.runtime.config_utils`: the helpers scripts and libraries build their own
DeepSpeed-style config blocks with, as DeepSpeed 0.19.8 names them: `DeepSpeedConfigModel`
(a pydantic model that drops "auto" values, refuses unknown keys and moves deprecated
fields to their replacements), the `get_*_param` readers, the JSON loader hook that
refuses duplicate keys, and `ScientificNotationEncoder` for printing configs.

shardwise's own config is parsed elsewhere (frontends/deepspeed/config/); these are for
code that subclasses or calls DeepSpeed's helpers itself.
"""

from __future__ import annotations

import collections
import json
from functools import reduce
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, field_serializer

from shardwise.frontends.deepspeed.api.utils.logging import logger

__all__ = ["DeepSpeedConfigModel", "DeepSpeedConfigObject", "ScientificNotationEncoder",
           "dict_raise_error_on_duplicate_keys", "get_config_default", "get_dict_param", "get_list_param",
           "get_scalar_param", "pp_int"]


class DeepSpeedConfigModel(BaseModel):
    """Base of DeepSpeed-style config blocks. A field declared with
    `Field(..., json_schema_extra={"deprecated": True, "new_param": "other", ...})` (or
    pydantic's extra keyword arguments) is deprecated: setting it warns and, when
    `new_param` (a dotted path into sub-blocks) is named and `set_new_param` is not False,
    moves its value, through `new_param_fn`, to that field; giving both is an error.
    Without `strict`, "auto" values are dropped (their defaults stand), as Hugging Face's
    integration writes them."""

    model_config = ConfigDict(validate_default=True, validate_assignment=True, use_enum_values=True,
                              populate_by_name=True, extra="forbid", arbitrary_types_allowed=True,
                              protected_namespaces=())

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if not strict:
            data = {key: value for key, value in data.items() if value != "auto" or key == "replace_method"}
        super().__init__(**data)
        self._deprecated_fields_check()

    def _deprecated_fields_check(self) -> None:
        for name, field in type(self).model_fields.items():
            if field.json_schema_extra and field.json_schema_extra.get("deprecated", False):
                self._process_deprecated_field(name)

    def _process_deprecated_field(self, name: str) -> None:
        extra = type(self).model_fields[name].json_schema_extra
        if name not in self.model_fields_set:
            return
        new_field = extra.get("new_param", "")
        note = extra.get("deprecated_msg", "")
        logger.warning(f"Config parameter {name} is deprecated" + (f" use {new_field} instead" if new_field else "")
                       + (f". {note}" if note else ""))
        if not new_field or not extra.get("set_new_param", True):
            return
        value = extra.get("new_param_fn", lambda x: x)(getattr(self, name))
        delattr(self, name)
        *parents, leaf = new_field.split(".")
        owner = reduce(getattr, parents, self)
        assert leaf not in owner.model_fields_set, (
            f"Cannot provide deprecated parameter '{name}' and replacing parameter '{new_field}' together")
        setattr(owner, leaf, value)

    @field_serializer("dtype", check_fields=False)
    def serialize_torch_dtype(dtype: torch.dtype) -> str:
        return str(dtype)


def get_config_default(config: type[BaseModel], field_name: str) -> Any:
    """The default of a config model's field (which must exist and not be required)."""
    assert field_name in config.model_fields, f"'{field_name}' is not a field in {config}"
    field = config.model_fields[field_name]
    assert not field.is_required(), f"'{field_name}' is a required field and does not have a default value"
    return field.get_default()


class pp_int(int):
    """An int printed with thousands separators (or a given text), for generated docs."""

    def __new__(cls, val: int, custom_print_str: str | None = None) -> pp_int:
        made = super().__new__(cls, val)
        made.custom_print_str = custom_print_str
        return made

    def __repr__(self) -> str:
        return self.custom_print_str if getattr(self, "custom_print_str", None) else f"{self.real:,}"


class ScientificNotationEncoder(json.JSONEncoder):
    """`json.dumps(config, cls=ScientificNotationEncoder)`: as JSON, indented, numbers over
    1e3 in scientific notation (1.000000e+04), so a printed config's bucket sizes read."""

    def iterencode(self, o: Any, _one_shot: bool = False, level: int = 0) -> str:
        indent = self.indent if self.indent is not None else 4
        closing = " " * level * indent
        inner = " " * (level + 1) * indent
        if isinstance(o, bool):
            return "true" if o else "false"
        if isinstance(o, (int, float)):
            return f"{o:e}" if o > 1e3 else f"{o}"
        if isinstance(o, collections.abc.Mapping):
            items = [f'\n{inner}"{key}": {self.iterencode(value, level=level + 1)}' for key, value in o.items()]
            return "{" + ", ".join(items) + f"\n{closing}" + "}"
        if isinstance(o, collections.abc.Sequence) and not isinstance(o, str):
            return "[" + ", ".join(self.iterencode(item) for item in o) + "]"
        return "\n, ".join(super().iterencode(o, _one_shot))


class DeepSpeedConfigObject:
    """An object whose repr is its attributes as JSON (ScientificNotationEncoder)."""

    def repr(self) -> dict:
        return self.__dict__

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4, cls=ScientificNotationEncoder)


def get_scalar_param(param_dict: dict, param_name: str, param_default_value: Any) -> Any:
    return param_dict.get(param_name, param_default_value)


def get_list_param(param_dict: dict, param_name: str, param_default_value: Any) -> Any:
    return param_dict.get(param_name, param_default_value)


def get_dict_param(param_dict: dict, param_name: str, param_default_value: Any) -> Any:
    return param_dict.get(param_name, param_default_value)


def dict_raise_error_on_duplicate_keys(ordered_pairs: list[tuple[str, Any]]) -> dict:
    """`json.load(..., object_pairs_hook=dict_raise_error_on_duplicate_keys)`: a key given
    twice in one object is an error naming it (plain JSON keeps the last silently)."""
    result = dict(ordered_pairs)
    if len(result) != len(ordered_pairs):
        counts = collections.Counter(key for key, _ in ordered_pairs)
        raise ValueError(f"Duplicate keys in DeepSpeed config: {[key for key, count in counts.items() if count > 1]}")
    return result
