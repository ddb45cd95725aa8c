"""Pipeline parallelism as a policy: how many stages, which schedule runs the micro-batches
through them, and how layers are assigned to stages (split.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved")
PARTITIONS = ("parameters", "uniform", "time")


@dataclass(frozen=True)
class PipelinePolicy:
    size: int = 1
    schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    micro_batches: int | None = None  # per optimizer step; None: the gradient accumulation steps
    virtual_stages: int = 1  # chunks per rank (interleaved 1F1B)
    partition: Literal["parameters", "uniform", "time"] = "parameters"
    split_points: tuple[int, ...] | None = None  # the first layer of every stage after the first
    profile_seq_len: int = 512  # sequence length the "time" partition measures layers at

    def __post_init__(self) -> None:
        if self.size < 1 or self.virtual_stages < 1:
            raise ValueError(f"pipeline size and virtual stages must be at least 1, got {self.size} and "
                             f"{self.virtual_stages}")
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(f"unknown pipeline schedule {self.schedule!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
        if self.partition not in PARTITIONS:
            raise ValueError(f"unknown pipeline partition {self.partition!r}; choose one of {', '.join(PARTITIONS)}")

    @property
    def enabled(self) -> bool:
        return self.size > 1
