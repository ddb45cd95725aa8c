"""A tensor-parallel plan: which module gets which style, where the decoder stack is, and
which sizes must divide by the tensor (or sequence) group.

The plans of known architectures live with each model family (shardwise/models/); a
user's model gets one through `shardwise.models.ModelPlan`. Grouped-query attention needs
no special case: q, k and v are split by heads separately, each rank keeping whole KV
heads and the query heads that use them, as long as the KV heads divide by the group.
Tied embeddings stay tied: embedding and output layer split the same vocabulary rows into
one local parameter.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Union

if TYPE_CHECKING:
    from shardwise.runtime.parallel.tensor.styles import Style


@dataclass(frozen=True)
class TensorPlan:
    """Styles by module-name pattern (a style's name, or a `Style` function for a module
    only one model family has), plus where the decoder stack and its final norm are
    (sequence parallelism splits the sequence between them) and the sizes that must divide."""

    styles: Mapping[str, Union[str, "Style"]]
    layers: str | None = None  # the ModuleList of decoder layers
    final_norm: str | None = None
    sizes: Mapping[str, int] = field(default_factory=dict)  # "what (config attribute)" -> value
    heads: int | None = None  # attention heads, for Ulysses
    kv_heads: int | None = None
    hf_loss: bool = False  # a Hugging Face model whose loss_function must become vocabulary-parallel


def check_divisible(plan: TensorPlan, size: int, key: str) -> None:
    """Every size the plan splits must divide by the group; the error names them all."""
    problems = [f"{what} {value}" for what, value in plan.sizes.items() if value % size]
    if problems:
        raise ValueError(f"{key} {size} must divide the model's {', '.join(problems)}: each rank takes an "
                         f"equal share; choose a {key} that divides them")


def matches(pattern: str, name: str) -> bool:
    """Part-by-part fnmatch: `blocks.*.mlp` matches `blocks.3.mlp`, not `blocks.3.x.mlp`."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names))
