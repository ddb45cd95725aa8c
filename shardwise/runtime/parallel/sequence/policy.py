"""Ulysses sequence parallelism as a policy: how many ranks share each sequence (their
attention exchanges positions for heads). Megatron's sequence parallelism lives inside the
tensor group instead (`TensorPolicy.sequence_parallel`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SequencePolicy:
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"sequence parallel size must be at least 1, got {self.size}")

    @property
    def enabled(self) -> bool:
        return self.size > 1
