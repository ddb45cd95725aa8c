"""How DeepSpeed's flops profiler writes numbers: a value scaled to T, G, M, K, (none), m
or u, rounded to `precision` decimals and printed with `:g`, then a unit. Scripts log
these strings and some parse them back, so they are DeepSpeed 0.19.8's to the character
(tests compare them with DeepSpeed's own)."""

from __future__ import annotations

__all__ = ["bytes_to_string", "duration_to_string", "flops_to_string", "macs_to_string", "number_to_string",
           "params_to_string"]

DEFAULT_PRECISION = 2
_MAGNITUDES = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "": 1, "m": 1e-3, "u": 1e-6}


def _units_for(num: float) -> str:
    """The largest prefix the number reaches; 0 and numbers from 1 up to 1000 take none."""
    for units in ("T", "G", "M", "K"):
        if num >= _MAGNITUDES[units]:
            return units
    if num >= 1 or num == 0:
        return ""
    return "m" if num >= 1e-3 else "u"


def number_to_string(num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """`num` scaled to `units` (chosen from its size when None; an unknown prefix scales by
    1), e.g. `number_to_string(1234567)` is "1.23 M"."""
    if units is None:
        units = _units_for(num)
    magnitude = _MAGNITUDES.get(units, 1)
    return f"{round(num / magnitude, precision):g} {units}"


def flops_to_string(flops: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(flops, units=units, precision=precision)}FLOPS"


def macs_to_string(macs: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(macs, units=units, precision=precision)}MACs"


def bytes_to_string(b: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(b, units=units, precision=precision)}B"


def params_to_string(params_num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """Parameters count billions as B (a `units` of "B" means G), with no trailing space."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params_num, units=units, precision=precision).replace("G", "B").strip()


def duration_to_string(duration: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(duration, units=units, precision=precision)}s"
