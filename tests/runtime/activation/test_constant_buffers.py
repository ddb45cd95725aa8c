"""Cb: transient buffers (gradient buckets, stage-3 gathers and prefetch, the fp32 gradient
copy of one optimizer sub-group, the buckets that carry gradients to an offloaded
optimizer, Pa's gathers) are bounded by configured sizes, not by the model: growing the
model 4x in depth leaves the `buffers` peak of memory_breakdown() unchanged, with
recomputation on (its gathers are kept for the backward that follows: one layer's units).
A Pa gather brings back one layer's input for its recomputation: it is part of the
recomputation working set, which stays one layer's whatever the depth.

With stage3_max_reuse_distance above 0 (DeepSpeed's default 1e9) stage 3 also keeps small
units gathered after their forward when they will be used again soon, as long as fewer than
stage3_max_live_parameters elements are gathered: that cache grows with depth up to the
configured bound, so the runs here set the reuse distance to 0 to see the other buffers."""

import pytest

from shardwise.tools.testing import run_distributed
from tests.runtime.activation.workers import buffers_after_training


def buffers_for_depths(rank: int, world_size: int, stage: int, dtype: str, policy: str,
                       extra: dict | None = None) -> list[dict]:
    return [buffers_after_training(rank, world_size, stage, layers, dtype, policy, extra=extra) for layers in (4, 16)]


OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}


@pytest.mark.parametrize(("stage", "dtype", "extra"), [(1, "fp32", None), (2, "bf16", None), (3, "fp32", None),
                                                       (3, "bf16", None), (2, "fp32", OFFLOAD), (3, "bf16", OFFLOAD)],
                         ids=["1-fp32", "2-bf16", "3-fp32", "3-bf16", "2-offload", "3-bf16-offload"])
def test_buffers_peak_unchanged_when_the_model_grows_4x(stage, dtype, extra):
    # over gloo: its reduce-scatters hold receive buffers at every stage (the shared-memory
    # transport holds none, which would leave stage 1 with nothing to compare)
    small, large = run_distributed(buffers_for_depths, 2, stage, dtype, "full", extra,
                                   env={"SHARDWISE_SHARED_MEMORY": "0"})[0]
    assert large["numel"] > 3.5 * small["numel"]
    assert large["memory"]["buffers"] == small["memory"]["buffers"] > 0
    assert large["memory"]["params"] > small["memory"]["params"]


def test_partitioned_checkpoint_gathers_unchanged_when_the_model_grows_4x():
    """TP = 2 with Pa: the checkpoints grow with depth (one half-input per layer), the
    buffers and the recomputation working set, which holds the gathered input, do not.

    The working set is one region's recomputation, plus at most the previous region's when
    a gloo thread still holds a tensor of its tensor-parallel all-reduce for a moment after
    the wait returned (how long depends on the machine's load): so it is bounded by twice
    the smaller run's, where growing with depth would give four times."""
    extra = {"tensor_parallel": {"size": 2}, "activation_checkpointing": {"partition_activations": True}}
    small, large = run_distributed(buffers_for_depths, 2, 1, "fp32", "full", extra)[0]
    assert large["memory"]["buffers"] == small["memory"]["buffers"]
    assert 0 < large["activations"]["recompute"] <= 2 * small["activations"]["recompute"]
    assert 0 < small["activations"]["recompute"] <= 2 * large["activations"]["recompute"]
    assert large["activations"]["checkpoints"] == 4 * small["activations"]["checkpoints"] > 0
