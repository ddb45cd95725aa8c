"""Reduced gradients reach the host partition through reused staging buffers, copied on a
side stream, and are added in only after the event of their own copy (C11).

There is no CUDA here, so the CUDA part is replaced by stand-ins (mocks of CUDA only):
`FakeStream` / `FakeEvent` record what `SideStream` asks of a stream and an event; in the
training runs, `DeferredCopies` performs each copy only when its event is waited for (on
the host or by the stream) or seen finished, which is the latest a real device may do it.
A reader that added a chunk before its event, or a reducer that wrote a bucket again
before the stream waited for the copy reading it, would then see other numbers, and
training would not equal the run without offload bit for bit."""

from contextlib import contextmanager

import pytest
import torch

from shardwise.runtime.accounting import MemoryLedger
from shardwise.runtime.zero import gradient_copies
from shardwise.runtime.zero.gradient_copies import STAGING_BUFFERS, GradientCopies, SideStream
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.test_host_offload import case_for
from tests.runtime.zero.workers import train_parallel


class FakeEvent:
    def __init__(self, log: list):
        self.log = log
        self.done = False

    def record(self, stream) -> None:
        self.log.append(("record", stream))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append(("synchronize", self))
        self.done = True

    def wait(self) -> None:
        self.log.append(("stream waits", self))


class FakeStream:
    def __init__(self, log: list):
        self.log = log

    def wait_stream(self, other) -> None:
        self.log.append(("wait_stream", other))


def fake_side_stream(log: list) -> SideStream:
    @contextmanager
    def use(stream):
        log.append(("enter", stream))
        yield
        log.append(("leave", stream))

    return SideStream(FakeStream(log), lambda: "current stream", use, lambda: FakeEvent(log))


def test_a_copy_waits_for_the_current_stream_then_records_its_event_on_the_side_stream():
    log = []
    side = fake_side_stream(log)
    target, source = torch.zeros(3), torch.arange(3.0)
    event = side.copy(target, source)
    assert [entry[0] for entry in log] == ["wait_stream", "enter", "record", "leave"]
    assert log[0][1] == "current stream" and log[2][1] is side.stream
    assert isinstance(event, FakeEvent) and target.equal(source)


def test_staging_buffers_are_allocated_once_and_each_unit_waits_for_its_own_copies():
    log, ledger = [], MemoryLedger()
    copies = GradientCopies(chunk_numel=8, pin=False, ledger=ledger, stream=fake_side_stream(log))
    targets = [torch.zeros(8), torch.zeros(5)]
    staging = set()
    for step in range(3):  # three backwards, two units each
        events = [copies.receive(unit, torch.full((target.numel(),), float(step + 1)), target)
                  for unit, target in enumerate(targets)]
        staging |= {copy.buffer.data_ptr() for copy in copies.pending}
        assert all(target.sum() == sum(range(1, step + 1)) * target.numel() for target in targets)  # not yet added
        log.clear()
        copies.settle([1])
        assert [entry for entry in log if entry[0] == "synchronize"] == [("synchronize", events[1])]
        assert targets[1].equal(torch.full((5,), float(sum(range(1, step + 2)))))
        copies.settle()
        assert targets[0].equal(torch.full((8,), float(sum(range(1, step + 2)))))
    assert len(staging) == 2  # the same two buffers every step
    assert ledger.breakdown_by_tier()["host"]["buffers"] == 2 * 8 * 4


def test_when_every_buffer_is_in_use_the_oldest_copy_is_added_first():
    log = []
    copies = GradientCopies(chunk_numel=4, pin=False, ledger=MemoryLedger(), stream=fake_side_stream(log))
    target = torch.zeros(4)
    events = [copies.receive(0, torch.ones(4), target) for _ in range(STAGING_BUFFERS)]
    assert target.sum() == 0
    copies.receive(0, torch.ones(4), target)  # no free buffer: the oldest is settled and reused
    assert ("synchronize", events[0]) in log and target.equal(torch.ones(4))
    assert len({copy.buffer.data_ptr() for copy in copies.pending}) == STAGING_BUFFERS
    events[1].done = True  # seen finished: added without a wait, in order
    copies.receive(0, torch.ones(4), target)
    assert target.equal(torch.full((4,), 2.0))
    copies.discard()
    assert not copies.pending and target.equal(torch.full((4,), 2.0))


def test_without_cuda_a_chunk_is_added_straight_into_the_partition():
    copies = GradientCopies(chunk_numel=4, pin=False, ledger=MemoryLedger(), stream=gradient_copies.side_stream_for(
        torch.device("cpu")))
    target = torch.ones(4)
    assert copies.receive(0, torch.ones(4, dtype=torch.bfloat16), target) is None
    assert target.equal(torch.full((4,), 2.0)) and not copies.free


class DeferredEvent:
    """The copy it ends runs only when it is waited for (a slow device: never seen
    finished before)."""

    def __init__(self, target: torch.Tensor, source: torch.Tensor, counts: dict):
        self.target, self.source, self.counts = target, source, counts

    def record(self, stream) -> None:
        pass

    def _complete(self) -> None:
        if self.source is not None:
            self.target.copy_(self.source)
            self.source = None

    def query(self) -> bool:
        return self.source is None

    def synchronize(self) -> None:
        self.counts["host waits"] += 1
        self._complete()

    def wait(self) -> None:
        self.counts["stream waits"] += 1
        self._complete()


class DeferredCopies(SideStream):
    def __init__(self, counts: dict, buffers: set):
        self.counts, self.buffers = counts, buffers

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> DeferredEvent:
        self.counts["copies"] += 1
        self.buffers.add(target.untyped_storage().data_ptr())
        return DeferredEvent(target, source, self.counts)


def train_with_deferred_copies(rank: int, world_size: int, case) -> dict:
    counts = {"copies": 0, "host waits": 0, "stream waits": 0}
    buffers: set[int] = set()
    gradient_copies_for = gradient_copies.side_stream_for
    from shardwise.runtime.zero import host_store

    host_store.side_stream_for = lambda device: DeferredCopies(counts, buffers)
    try:
        result = train_parallel(rank, world_size, case)
    finally:
        host_store.side_stream_for = gradient_copies_for
    return {**result, **counts, "staging buffers": len(buffers)}


@pytest.mark.parametrize(("stage", "accumulation"), [(1, 1), (2, 2), (3, 1)])
def test_offload_with_copies_as_late_as_a_device_may_make_them_trains_like_no_offload(stage, accumulation):
    plain = run_distributed(train_parallel, 2, case_for(stage, accumulation=accumulation))
    offloaded = run_distributed(train_with_deferred_copies, 2, case_for(stage, "cpu", accumulation=accumulation))
    for without, with_offload in zip(plain, offloaded):
        assert with_offload["losses"] == without["losses"]
        for name, tensor in without["params"].items():
            assert with_offload["params"][name].equal(tensor), name
        # one copy per unit per backward (stages 2-3) or per step (stage 1), into the same few buffers
        assert with_offload["copies"] == 3 * with_offload["units"] * (accumulation if stage > 1 else 1)
        staging = with_offload["staging buffers"]
        assert 0 < staging <= STAGING_BUFFERS
        chunk_bytes = with_offload["largest_unit"] // 2 * 4  # fp32 chunks of the largest unit
        assert with_offload["memory_by_tier"]["host"]["buffers"] == staging * chunk_bytes
        assert with_offload["host waits"] + with_offload["stream waits"] >= with_offload["copies"]
        if stage > 1:  # a bucket a copy read, taken again: the stream waited for the copy first
            assert with_offload["stream waits"] > 0
