"""Tensor parallelism as a policy: how many ranks split each layer's weights, and whether
the parts between the split layers also split the sequence (Megatron sequence parallelism)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorPolicy:
    size: int = 1
    sequence_parallel: bool = False  # Megatron's: norms, dropout and residuals on 1/size of the sequence

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tensor parallel size must be at least 1, got {self.size}")

    @property
    def enabled(self) -> bool:
        return self.size > 1
