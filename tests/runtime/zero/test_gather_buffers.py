"""Stage 3's gathered buffers on the CPU are reused, not reallocated (runtime/zero/gather_buffers.py):
a freed buffer's memory goes to the next gather of its size, the pool never holds more than
the most gathered at once, and training is bit for bit what it is without the pool."""

import pytest
import torch

import shardwise
from shardwise.runtime.zero import gather_buffers, shared_param_home
from shardwise.runtime.zero.gather_buffers import GatherBuffers
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.workers import build_model, global_batch

needs_swap = pytest.mark.skipif(not gather_buffers.STORAGES_SWAP,
                                reason="this torch has no UntypedStorage._swap_data_ptr_: the pool is off")


def _empty_storage(numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat tensor with no memory and a view of it made while it had some (as autograd keeps)."""
    flat = torch.empty(numel)
    view = flat[2:6]
    flat.untyped_storage().resize_(0)
    return flat, view


@needs_swap
def test_a_freed_buffer_is_handed_to_the_next_gather_of_its_size_and_views_see_the_data():
    buffers = GatherBuffers(reuse=True, keep_bytes=0)
    first, _ = _empty_storage(64)
    buffers.fill(first.untyped_storage(), 256)
    address = first.untyped_storage().data_ptr()
    buffers.empty(first.untyped_storage())
    assert first.untyped_storage().nbytes() == 0 and buffers.spare_bytes == 256

    second, view = _empty_storage(64)
    buffers.fill(second.untyped_storage(), 256)
    assert second.untyped_storage().data_ptr() == address and buffers.spare_bytes == 0
    second.copy_(torch.arange(64.0))
    assert view.tolist() == [2.0, 3.0, 4.0, 5.0]  # a view made before the memory arrived reads it


@needs_swap
def test_spares_and_gathered_buffers_stay_under_the_most_gathered_at_once():
    buffers = GatherBuffers(reuse=True, keep_bytes=0)
    small, other_small, large = (_empty_storage(numel)[0].untyped_storage() for numel in (25, 25, 50))
    buffers.fill(small, 100)
    buffers.fill(other_small, 100)
    buffers.empty(small)
    buffers.empty(other_small)
    assert (buffers.peak_bytes, buffers.spare_bytes) == (200, 200)
    buffers.fill(large, 200)  # no spare of its size: both small ones go first, or 400 bytes would be held
    assert (buffers.spare_bytes, buffers.live_bytes, buffers.fresh_fills) == (0, 200, 3)
    buffers.empty(large)
    small_again = _empty_storage(25)[0].untyped_storage()
    buffers.fill(small_again, 100)  # 100 live + 200 spare would pass the peak of 200: the spare goes
    assert (buffers.spare_bytes, buffers.live_bytes) == (0, 100)


@needs_swap
def test_between_passes_at_most_keep_bytes_stay_and_release_returns_them_all():
    buffers = GatherBuffers(reuse=True, keep_bytes=150)
    storages = [_empty_storage(25)[0].untyped_storage() for _ in range(3)]
    for storage in storages:
        buffers.fill(storage, 100)
    for storage in storages:
        buffers.empty(storage)
    buffers.end_pass()
    assert buffers.spare_bytes == 100
    buffers.release()
    assert buffers.spare_bytes == 0 and buffers.spares == {}


def test_without_reuse_a_freed_buffer_goes_back_to_the_allocator():
    buffers = GatherBuffers(reuse=False, keep_bytes=1 << 20)
    flat, view = _empty_storage(64)
    buffers.fill(flat.untyped_storage(), 256)
    flat.fill_(1.0)
    assert view.tolist() == [1.0] * 4
    buffers.empty(flat.untyped_storage())
    assert flat.untyped_storage().nbytes() == 0 and buffers.spare_bytes == 0 and buffers.fresh_fills == 1


STEPS = 4


def train(rank: int, world_size: int, reuse: bool) -> dict:
    gather_buffers.STORAGES_SWAP = reuse and gather_buffers.STORAGES_SWAP  # this rank's process only
    model = build_model("gpt")
    config = {"train_micro_batch_size_per_gpu": 2,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 64,
                                    "stage3_max_reuse_distance": 0, "reduce_bucket_size": 3000}}
    engine = shardwise.initialize(model, config, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    buffers = engine.zero.params.sharded.buffers
    losses, fresh_fills = [], []
    for step in range(STEPS):
        x, y = global_batch(step, 2 * world_size)
        rows = slice(rank * 2, (rank + 1) * 2)
        loss = torch.nn.functional.cross_entropy(engine(x[rows]).flatten(0, 1), y[rows].flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        fresh_fills.append(buffers.fresh_fills)
    kept = buffers.spare_bytes
    engine.zero.release_gathered()  # what DeepSpeed's engine.empty_partition_cache() calls
    after_release = buffers.spare_bytes
    with shardwise.gathered_parameters(list(model.parameters())):
        weights = [param.detach().clone() for param in model.parameters()]
    buffers.keep_bytes = 0  # a prefetch bucket smaller than any unit: nothing may stay between passes
    with shardwise.gathered_parameters(list(model.parameters())):
        pass
    after_gathered = buffers.spare_bytes
    with torch.no_grad():
        engine(x[rows])
    after_no_grad_forward = buffers.spare_bytes
    return {"losses": losses, "weights": weights, "fresh_fills": fresh_fills, "kept": kept,
            "after_release": after_release, "after_gathered": after_gathered,
            "after_no_grad_forward": after_no_grad_forward, "reuse": buffers.reuse}


@needs_swap
def test_stage3_training_reuses_gathered_memory_and_matches_the_run_without_it():
    copying = {shared_param_home.ENABLE_VARIABLE: "0"}  # shared parameters gather without buffers
    pooled = run_distributed(train, 2, True, env=copying)
    plain = run_distributed(train, 2, False, env=copying)
    for with_pool, without in zip(pooled, plain):
        assert with_pool["reuse"] and not without["reuse"]
        assert with_pool["losses"] == without["losses"]
        for a, b in zip(with_pool["weights"], without["weights"]):
            assert torch.equal(a, b)
        # the first step gathers on demand, the second prefetches along the recorded order (more
        # units live at once); from then on every gather finds a spare
        warmed = with_pool["fresh_fills"][1]
        assert with_pool["fresh_fills"][2:] == [warmed] * (STEPS - 2)
        assert all(a < b for a, b in zip(without["fresh_fills"], without["fresh_fills"][1:]))  # every gather allocates
        assert with_pool["kept"] > 0 and with_pool["after_release"] == 0
        # a gathered_parameters block and a forward without gradients end a pass too (no backward follows)
        assert with_pool["after_gathered"] == 0 and with_pool["after_no_grad_forward"] == 0
