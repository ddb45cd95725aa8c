"""Cb: transient buffers (gradient buckets, stage-3 gathers and prefetch, the fp32 gradient
copy of one optimizer sub-group) are bounded by configured sizes, not by the model: growing
the model 4x in depth leaves the `buffers` peak of memory_breakdown() unchanged, with
recomputation on (its gathers are kept for the backward that follows: one layer's units).

With stage3_max_reuse_distance above 0 (DeepSpeed's default 1e9) stage 3 also keeps small
units gathered after their forward when they will be used again soon, as long as fewer than
stage3_max_live_parameters elements are gathered: that cache grows with depth up to the
configured bound, so the runs here set the reuse distance to 0 to see the other buffers."""

import pytest

from shardwise.testing import run_distributed
from tests.activation.workers import buffers_after_training


def buffers_for_depths(rank: int, world_size: int, stage: int, dtype: str, policy: str) -> list[dict]:
    return [buffers_after_training(rank, world_size, stage, layers, dtype, policy) for layers in (4, 16)]


@pytest.mark.parametrize(("stage", "dtype"), [(1, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")])
def test_buffers_peak_unchanged_when_the_model_grows_4x(stage, dtype):
    small, large = run_distributed(buffers_for_depths, 2, stage, dtype, "full")[0]
    assert large["numel"] > 3.5 * small["numel"]
    assert large["memory"]["buffers"] == small["memory"]["buffers"] > 0
    assert large["memory"]["params"] > small["memory"]["params"]
