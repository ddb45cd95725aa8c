"""Cb for ZeRO-Infinity: the host memory that NVMe paging stages through is bounded by the
configured buffers, not by the model. Parameter shards: at most offload_param.buffer_count
x buffer_size elements in memory at once (offload/param_home.py); optimizer sub-groups: at
most three pages (reading, stepping, writing) of sub_group_size elements x (master + the
optimizer's state tensors). The engine's own counter (memory_breakdown's `buffers` on the
host tier, its peak) stays under that sum and does not change when the model grows 4x."""

import pytest

from shardwise.runtime.zero.swap import round_up
from shardwise.tools.testing import DistributedTestError, run_distributed
from tests.runtime.activation.workers import batch, tiny_gpt

BUFFER_COUNT, BUFFER_SIZE, SUB_GROUP = 3, 4096, 2048


def staging_after_training(rank: int, world_size: int, layers: int, path: str, buffer_size: int = BUFFER_SIZE) -> dict:
    import shardwise

    engine = shardwise.initialize(tiny_gpt(n_layer=layers, dropout=0.0), {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3, "reduce_bucket_size": 4096, "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0, "sub_group_size": SUB_GROUP,
            "offload_optimizer": {"device": "nvme", "nvme_path": path},
            "offload_param": {"device": "nvme", "nvme_path": path, "buffer_count": BUFFER_COUNT,
                              "buffer_size": buffer_size},
        },
    })
    for step in range(2):
        x, y = batch(step, 2 * world_size)
        loss = engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
        engine.backward(loss)
        engine.step()
    return {"tiers": engine.memory_breakdown(by_tier=True), "numel": engine.num_parameters()}


def staging_for_depths(rank: int, world_size: int, path: str) -> list[dict]:
    return [staging_after_training(rank, world_size, layers, path) for layers in (2, 8)]


def test_nvme_staging_is_bounded_by_the_buffers_and_not_by_the_model(tmp_path):
    small, large = run_distributed(staging_for_depths, 2, str(tmp_path))[0]
    assert large["numel"] > 3.5 * small["numel"]
    parameter_buffers = BUFFER_COUNT * BUFFER_SIZE * 4  # fp32 shards
    optimizer_pages = 3 * 3 * round_up(SUB_GROUP * 4)  # master + Adam's two moments
    for run in (small, large):
        # the shards alone would not fit: paging had to write some out to stay under the bound
        assert run["tiers"]["nvme"]["params"] > parameter_buffers
        assert 0 < run["tiers"]["host"]["buffers"] <= parameter_buffers + optimizer_pages
    assert large["tiers"]["host"]["buffers"] == small["tiers"]["host"]["buffers"]


def test_a_buffer_smaller_than_a_shard_is_refused_with_the_sizes(tmp_path):
    """One rank: a unit's shard is the whole unit (the MLP's 4,096-element matrix)."""
    with pytest.raises(DistributedTestError, match=r"SwapError: offload_param.buffer_count 3 x buffer_size 1,000 "
                                                   r"elements cannot stage the largest parameter shard \(4,096"):
        run_distributed(staging_after_training, 1, 1, str(tmp_path), 1000)
