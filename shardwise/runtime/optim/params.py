"""How an optimizer declares the `params` a config may give it.

A declaration is a frozen dataclass beside the optimizer (`LambParams` in optim/lamb.py):
one field per accepted constructor argument, with its default and what a value must
satisfy, written with `param`. Checks of several fields together go in
`__post_init__`, raising ValueError. The DeepSpeed front end turns a declaration into its
validating model (frontends/deepspeed/config/params.py), so the config's keys, defaults,
ranges and the documented defaults table all come from the optimizer's own file, and the
runtime stays free of the front end's validation library.
"""

from __future__ import annotations

from dataclasses import Field, field
from typing import Any, Callable

# The keys `param` writes into a field's metadata, read by the front end.
BOUNDS = ("ge", "gt", "le", "lt")


def param(
    default: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    check: Callable[[Any], Any] | None = None,
    description: str | None = None,
    default_doc: str | None = None,
) -> Field:
    """A field of a params declaration: its default, bounds on a number (`ge` >=, `gt` >,
    `le` <=, `lt` <), `check` (takes the value, returns it or raises ValueError), a
    `description` for the reference, and `default_doc`, what the reference shows as the
    default when it is another key's value ("lr")."""
    given = {"ge": ge, "gt": gt, "le": le, "lt": lt, "check": check, "description": description,
             "default_doc": default_doc}
    return field(default=default, metadata={key: value for key, value in given.items() if value is not None})


def check_betas(betas: tuple[float, float]) -> tuple[float, float]:
    """Adam-style betas: each in [0, 1)."""
    if not all(0.0 <= beta < 1.0 for beta in betas):
        raise ValueError(f"betas {list(betas)} must each lie in [0, 1)")
    return betas


def check_nesterov(nesterov: bool, momentum: float, dampening: float) -> None:
    """SGD-style Nesterov momentum needs momentum and no dampening."""
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"nesterov needs momentum > 0 and dampening 0, got momentum {momentum} and dampening {dampening}"
        )

