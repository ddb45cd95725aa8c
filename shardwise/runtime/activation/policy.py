"""Recomputation policies: which layers run as checkpointed regions, and how.

    none        every layer keeps its activations
    full        every layer is a region: it keeps only its input, and is re-run in
                backward (one extra forward; memory n·input + one layer)
    every_k     every k-th layer (0, k, 2k, ...) is a region, the others keep their
                activations (torchtitan's layer selection): a dial between none and full
    selective   every layer is a region that also keeps some operator outputs
                (selective.py), so its recomputation is cheap
    sqrt        ⌈n/g⌉ regions of g = ⌈√n⌉ consecutive layers (Chen et al., 2016): only
                segment inputs are kept, and backward re-runs one segment at a time, so
                memory is ⌈n/g⌉·input + g·layer, O(√n) in the number of layers
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

PolicyName = Literal["none", "full", "every_k", "selective", "sqrt"]
POLICIES: tuple[PolicyName, ...] = ("none", "full", "every_k", "selective", "sqrt")


@dataclass(frozen=True)
class RecomputePolicy:
    name: PolicyName = "full"
    every_k: int = 2
    selective_rule: str = "linear_outputs"

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown recomputation policy {self.name!r}; choose one of {', '.join(POLICIES)}")
        if self.every_k < 1:
            raise ValueError(f"every_k must be at least 1, got {self.every_k}")

    def regions(self, num_layers: int) -> list[range]:
        """The layer index ranges run as one checkpointed region each, in order."""
        if self.name == "none" or num_layers == 0:
            return []
        if self.name == "every_k":
            return [range(i, i + 1) for i in range(0, num_layers, self.every_k)]
        if self.name == "sqrt":
            size = sqrt_segment(num_layers)
            return [range(i, min(i + size, num_layers)) for i in range(0, num_layers, size)]
        return [range(i, i + 1) for i in range(num_layers)]


def sqrt_segment(num_layers: int) -> int:
    """Layers per segment of the √n policy: ⌈√n⌉."""
    return math.isqrt(num_layers - 1) + 1 if num_layers > 1 else 1


@dataclass(frozen=True)
class ActivationPolicy:
    """What recomputation does and where the inputs it keeps live (DeepSpeed's
    activation-checkpointing settings): `partition_activations` splits each kept input over
    the tensor group (ZeRO-R's Pa), `cpu_checkpointing` keeps it in host memory,
    `contiguous_memory_optimization` in one preallocated buffer of `number_checkpoints`
    slots (Md); `synchronize` waits for the device at region edges; `profile` times regions.

    `count_saved`: count what each forward saves for backward ("activations" in
    `memory_breakdown()`), through torch's saved-tensor hooks. Under any such hook a
    backward gets its saved tensors back as new aliases: a parameter comes back a plain
    tensor without its attributes, which code that reads ZeRO-3's attributes of a saved
    parameter in its backward cannot take (TRL's chunked log-probability reads `ds_status`;
    DeepSpeed installs no hook). `deepspeed.initialize` turns it off at stage 3."""

    recompute: RecomputePolicy = RecomputePolicy("none")
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize: bool = False
    profile: bool = False
    count_saved: bool = True

    @property
    def recomputes(self) -> bool:
        return self.recompute.name != "none"
