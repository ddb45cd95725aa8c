"""Rank functions the GPU tests share: the CPU suite's workers, several runs per launch.

A rank process costs seconds to start on a GPU machine (CUDA and NCCL initialisation), so
a test module trains its cases one after the other in one launch and its tests read their
own case's result.
"""

from __future__ import annotations

import gc

import shardwise
from tests.runtime.distributed.workers import counted_collectives
from tests.gpu.target import pinned_host_bytes
from tests.runtime.zero import workers as zero_workers
from tests.runtime.zero.workers import Case


def train_cases(rank: int, world_size: int, cases: list[Case]) -> list[dict]:
    """tests/zero's `train_parallel` for each case, with the collectives each issued, the
    page-locked host bytes its engine held at the end, and its engine's device type."""
    results = []
    for case in cases:
        engines = []
        initialize = shardwise.initialize

        def recording(*args, **kwargs):
            engines.append(initialize(*args, **kwargs))
            return engines[-1]

        zero_workers.shardwise.initialize = recording  # this rank's own process
        try:
            with counted_collectives() as counts:
                result = zero_workers.train_parallel(rank, world_size, case)
        finally:
            zero_workers.shardwise.initialize = initialize
        result.update(collectives=dict(counts), pinned=pinned_host_bytes(), device=engines[0].device.type)
        engines[0].destroy()  # closes its swap files, if any
        engines.clear()
        gc.collect()  # this engine's pinned buffers are not counted for the next case
        results.append(result)
    return results
