"""Scalar field types and the base model shared by every configuration section.

JSON has one number type, so DeepSpeed configs routinely write integer sizes as
floats (`"reduce_bucket_size": 5e8`); those must become ints. Pydantic's lax mode
does that, but it would also turn `true` into 1 and `"8"` into 8, hiding typos in
hand-written configs. These types keep the float-to-int conversion and refuse
booleans and strings where a number belongs, and numbers where a boolean belongs.

Python's JSON reader also accepts `NaN`, `Infinity` and `-Infinity`, which no
setting can mean: a NaN learning rate or clipping norm would poison every weight
at the first step, far from the config line that caused it. Numbers must be finite.
"""

import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, StrictBool


def _finite_number(value: Any) -> Any:
    if isinstance(value, (bool, str)):
        raise ValueError(f"expected a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(
            f"{value} is not a finite number: NaN and Infinity (which Python's JSON reader accepts) "
            "are not valid settings; give a finite number"
        )
    return value


Int = Annotated[int, BeforeValidator(_finite_number)]
Float = Annotated[float, BeforeValidator(_finite_number)]
Bool = StrictBool


class Section(BaseModel):
    """A block of the JSON config: unknown keys are errors, never silently dropped."""

    model_config = ConfigDict(extra="forbid")
