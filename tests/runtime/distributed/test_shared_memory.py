"""Ranks on one host exchange all-gathers, reduce-scatters and all-reduces through a shared segment
(shared_memory.py, issue 27 item 2): the same results and bytes as gloo, and a peer that
is gone or late fails the collective naming it instead of hanging."""

import datetime
import os
import time
import uuid

import pytest
import torch

from shardwise.runtime.distributed import shared_memory
from shardwise.tools.testing import run_distributed
from shardwise.tools.testing.forkserver import preloaded_forkserver_context
from tests.runtime.distributed.workers import (
    join_shared_segment_and_exit,
    shared_and_gloo_collectives,
    stall_in_shared_memory,
    train_through_shared_memory,
)
from tests.runtime.zero.workers import Case, assert_matches_reference, train_reference

SMALL_SLOT = 4096  # bytes: the larger sizes below cross several slots
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
needs_compiler = pytest.mark.skipif(shared_memory.library() is None, reason="no C compiler to build the transport")


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


@needs_compiler
@pytest.mark.parametrize(("world_size", "dtype"), [(2, "float32"), (3, "bfloat16"), (3, "float32")])
def test_equals_gloo_for_odd_sizes_and_sizes_above_a_slot(world_size, dtype):
    sizes = [1, 7, 1001, 5000]  # 5000 fp32 elements per rank: 20,000 bytes per slot of 4,096
    results = run_distributed(shared_and_gloo_collectives, world_size, dtype, sizes,
                              env={shared_memory.SLOT_VARIABLE: str(SMALL_SLOT)})
    for result in results:
        assert result["shared_used"] and not result["gloo_used_shared"]
        shared_volume, gloo_volume = result["volume"]
        assert shared_volume == gloo_volume  # the ring model's bytes either way
        for size, outcome in zip(sizes, result["results"]):
            for gathered in ("gathered", "pieces"):
                assert torch.equal(outcome["shared"][gathered], outcome["gloo"][gathered]), (size, gathered)
            for reduced in ("reduced", "in_place", "summed", "divided"):
                error = relative(outcome["shared"][reduced], outcome["gloo"][reduced])
                assert error < TOLERANCE[dtype], (size, reduced, error)
            # divided while copied: the very bits of dividing first, then summing in member order
            assert torch.equal(outcome["shared"]["divided"], outcome["divided_expected"]), size
    for size_index in range(len(sizes)):  # an all-reduce leaves the same bits on every rank
        sums = [result["results"][size_index]["shared"]["summed"] for result in results]
        assert all(torch.equal(summed, sums[0]) for summed in sums)


@needs_compiler
def test_zero3_trains_like_one_process_through_shared_memory():
    case = Case(stage=3, extra_config={"zero_optimization": {"stage3_param_persistence_threshold": 0}})
    results = run_distributed(train_through_shared_memory, 2, case, env={
        shared_memory.ENABLE_VARIABLE: "1", shared_memory.SLOT_VARIABLE: str(SMALL_SLOT)})
    expected = train_reference(Case(), 2)
    for result in results:
        assert result["shared_segments"] >= 1  # the shard group's gathers and reductions went through it
        assert_matches_reference(result, expected, 1e-5)


@needs_compiler
def test_a_rank_that_never_calls_fails_the_collective_within_the_timeout():
    started = time.monotonic()
    message = run_distributed(stall_in_shared_memory, 2, timeout=60, env={"SHARDWISE_COLLECTIVE_TIMEOUT": "2"})[0]
    assert message.startswith("rank 0: all_gather of parameters of unit 2 in the shard group (ranks 0-1) failed after")
    assert "rank 1 did not reach the collective within 2s (shared-memory transport)" in message
    assert time.monotonic() - started < 30


@needs_compiler
def test_a_peer_whose_process_exits_is_named_at_once():
    kernels = shared_memory.library()
    slot = SMALL_SLOT
    nbytes = shared_memory.segment_bytes(2, slot)
    path = f"/dev/shm/shardwise-test-{uuid.uuid4().hex}"
    base, status = shared_memory.map_segment(kernels, path, nbytes, create=True)
    assert status == 0
    try:
        peer = preloaded_forkserver_context().Process(target=join_shared_segment_and_exit, args=(path, nbytes, slot))
        peer.start()
        channel = shared_memory.SharedMemoryChannel(kernels, base, rank=0, global_ranks=(0, 1), slot=slot,
                                                    timeout=datetime.timedelta(seconds=60))
        pieces = [torch.empty(4), torch.empty(4)]
        channel.all_gather(pieces, torch.zeros(4)).wait()
        assert torch.equal(pieces[1], torch.ones(4))  # the peer's shard
        peer.join(30)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1's process exited \(shared-memory transport\)"):
            channel.all_gather(pieces, torch.zeros(4)).wait()
        assert time.monotonic() - started < 5  # not the 60 s timeout
        with pytest.raises(RuntimeError, match="rank 1's process exited"):  # and every later one at once
            channel.reduce_scatter(torch.empty(2), torch.zeros(4)).wait()
    finally:
        os.unlink(path)
