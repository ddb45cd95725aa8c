"""Scalar field types and the base model shared by every configuration section.

JSON has one number type, so DeepSpeed configs routinely write integer sizes as
floats (`"reduce_bucket_size": 5e8`); those must become ints. Pydantic's lax mode
does that, but it would also turn `true` into 1 and `"8"` into 8, hiding typos in
hand-written configs. These types keep the float-to-int conversion and refuse
booleans and strings where a number belongs, and numbers where a boolean belongs.
"""

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, StrictBool


def _reject_bool_and_str(value: Any) -> Any:
    if isinstance(value, (bool, str)):
        raise ValueError(f"expected a number, got {value!r}")
    return value


Int = Annotated[int, BeforeValidator(_reject_bool_and_str)]
Float = Annotated[float, BeforeValidator(_reject_bool_and_str)]
Bool = StrictBool


class Section(BaseModel):
    """A block of the JSON config: unknown keys are errors, never silently dropped."""

    model_config = ConfigDict(extra="forbid")
