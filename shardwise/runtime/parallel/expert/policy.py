"""Expert parallelism as a policy, for models whose plan spreads their experts (a Hugging
Face Mixtral's stacked experts, models/hf/experts.py): how many ranks of each data-parallel
group split each MoE layer's experts among them. A layer that carries its own size
(DeepSpeed's `MoE(ep_size=...)`) does not read it. `data_before_expert` (DeepSpeed's
`use_data_before_expert_parallelism`) orders every layer's groups: the ranks sharing
experts consecutive, an expert group strided (runtime/distributed/mesh.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertPolicy:
    size: int = 1
    data_before_expert: bool = False

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"expert parallel size must be at least 1, got {self.size}")

    @property
    def enabled(self) -> bool:
        return self.size > 1
