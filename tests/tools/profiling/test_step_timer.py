"""The per-step time split: phases exclude the collective waits inside them, which are
reported on their own, so the parts add up to the step; on CUDA from events read once
per step, never synchronising inside it, and nothing at all when timings are off."""

import time

import numpy as np
import pytest
import torch

import shardwise
from shardwise.tools.data import BlockSampler
from shardwise.runtime.distributed.collectives import CommStats, Communicator, PendingCollective
from shardwise.runtime.distributed.mesh import GroupHandle
from shardwise.tools.profiling import StepTimer, process_memory
from shardwise.tools.train.loop import train_step
from tests.runtime.zero.workers import build_model


class WaitClock(CommStats):
    """Stands in for the engine's `comm_stats`: seconds spent blocked on collectives."""

    def block(self, seconds: float) -> float:
        """Sleep about `seconds`; counts and returns the time it took (a loaded machine oversleeps)."""
        started = time.perf_counter()
        time.sleep(seconds)
        waited = time.perf_counter() - started
        self.wait_seconds += waited
        return waited


def test_comm_waits_are_moved_out_of_the_phase_they_happen_in():
    clock = WaitClock()
    timer = StepTimer(clock, torch.device("cpu"))
    timer.start_step()
    with timer.phase("forward"):
        time.sleep(0.02)
    started = time.perf_counter()
    with timer.phase("backward"):
        time.sleep(0.03)
        waited = clock.block(0.05)
    backward_wall = time.perf_counter() - started
    with timer.phase("optimizer"):
        time.sleep(0.01)
    times = timer.end_step()
    assert times.comm_wait == pytest.approx(waited)
    # the wait is taken out of backward, which keeps the rest of its time
    assert times.backward >= 0.03 and times.backward == pytest.approx(backward_wall - waited, abs=0.005)
    assert times.forward >= 0.02 and times.optimizer >= 0.01
    parts = times.data + times.forward + times.backward + times.optimizer + times.comm_wait
    assert parts == pytest.approx(times.step, abs=0.02)
    assert set(times.as_dict()) == {"data", "forward", "backward", "optimizer", "comm_wait", "step"}


def test_phases_accumulate_over_micro_batches_and_reset_per_step():
    timer = StepTimer(CommStats(), torch.device("cpu"))
    timer.start_step()
    for _ in range(3):
        with timer.phase("forward"):
            time.sleep(0.01)
    assert timer.end_step().forward >= 0.03
    timer.start_step()
    assert timer.end_step().forward == 0.0


def test_misuse_is_reported():
    timer = StepTimer(CommStats(), torch.device("cpu"))
    with pytest.raises(RuntimeError, match="start_step"):
        with timer.phase("forward"):
            pass
    timer.start_step()
    with pytest.raises(ValueError, match="unknown phase 'loss'"):
        with timer.phase("loss"):
            pass


def test_process_memory_reports_current_and_peak_bytes():
    before = process_memory(torch.device("cpu"))
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    after = process_memory(torch.device("cpu"))
    assert after["current"] >= before["current"] + 32 * 2**20
    assert after["peak"] >= after["current"]
    del block


class CudaStandIn:
    """Stands in for CUDA (this machine has none): events stamped with the host clock
    when recorded, and counters of every synchronisation asked for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.events = 0
        self.event_waits = 0
        self.synchronizes = 0
        stand_in = self

        class Event:
            def __init__(self, enable_timing: bool = False):
                assert enable_timing
                stand_in.events += 1
                self.stamp = None

            def record(self, stream=None) -> None:
                self.stamp = time.perf_counter()

            def synchronize(self) -> None:
                stand_in.event_waits += 1

            def elapsed_time(self, end: "Event") -> float:
                return (end.stamp - self.stamp) * 1e3

        def synchronize(device=None) -> None:
            stand_in.synchronizes += 1

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", synchronize)


class StallingWork:
    """An NCCL collective's work handle: here its wait takes `seconds` on the host clock
    (which the stand-in events read), as the device stream would stall on a real one."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def wait(self, timeout=None) -> bool:
        time.sleep(self.seconds)
        return True


def nccl_wait(stats: CommStats, monkeypatch: pytest.MonkeyPatch, seconds: float) -> float:
    """Wait on a collective of a stand-in NCCL group (`dist.get_backend` patched); returns
    how long the wait took on the host clock (a loaded machine oversleeps)."""
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    comm = Communicator(GroupHandle("shard", (0, 1), 0, object(), None), stats)
    started = time.perf_counter()
    PendingCollective(StallingWork(seconds), "all_gather", "parameters of unit 0", comm).wait()
    return time.perf_counter() - started


def test_on_cuda_phases_and_waits_come_from_events_read_once_per_step(monkeypatch):
    cuda = CudaStandIn(monkeypatch)
    stats = CommStats()
    timer = StepTimer(stats, torch.device("cuda", 0))
    nccl_wait(stats, monkeypatch, 0.01)  # between steps nothing is recorded
    assert stats.device_waits is None and cuda.events == 0
    timer.start_step()
    waited = forward = 0.0  # the host clock's own account (a loaded machine oversleeps every sleep)
    for _ in range(2):  # two micro-batches
        started = time.perf_counter()
        with timer.phase("forward"):
            time.sleep(0.02)
            waited += nccl_wait(stats, monkeypatch, 0.03)
        forward += time.perf_counter() - started
        with timer.phase("backward"):
            time.sleep(0.01)
    assert cuda.event_waits == 0  # nothing waits on the device inside the step
    times = timer.end_step()
    assert waited >= 0.06 and times.comm_wait == pytest.approx(waited, abs=0.005)
    assert times.forward == pytest.approx(forward - waited, abs=0.005)  # the waits are taken out
    assert times.backward >= 0.02
    parts = times.data + times.forward + times.backward + times.optimizer + times.comm_wait
    assert parts == pytest.approx(times.step, abs=0.01)
    assert cuda.synchronizes == 0 and cuda.event_waits == 1  # one wait, for the step's last event
    assert stats.device_waits is None


def test_with_timings_off_a_cuda_step_records_and_waits_for_nothing(monkeypatch):
    cuda = CudaStandIn(monkeypatch)
    stats = CommStats()
    timer = StepTimer(stats, torch.device("cuda", 0), enabled=False)
    timer.start_step()
    with timer.phase("forward"):
        nccl_wait(stats, monkeypatch, 0.0)
    assert timer.end_step() is None
    assert (cuda.events, cuda.event_waits, cuda.synchronizes) == (0, 0, 0)


@pytest.fixture(scope="module")
def engine():
    return shardwise.initialize(build_model("gpt"), {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2},
    })


@pytest.mark.parametrize("enabled", [False, True])
def test_the_main_jobs_step_synchronises_nothing_and_times_only_when_asked(engine, monkeypatch, enabled):
    """A real step (two micro-batches) on the CPU, timed as on CUDA (stand-in events)."""
    cuda = CudaStandIn(monkeypatch)
    tokens = np.random.default_rng(0).integers(0, engine.module.config.vocab_size, 4096)
    sampler = BlockSampler(tokens, 16, engine.config.train_batch_size, seed=0)
    timer = StepTimer(engine.comm_stats, torch.device("cuda", 0), enabled=enabled)
    loss, times, _ = train_step(engine, sampler, 0, timer)
    assert cuda.synchronizes == 0
    assert cuda.event_waits == (1 if enabled else 0)
    assert np.isfinite(loss)
    if enabled:
        assert times.forward > 0 and times.backward > 0 and times.optimizer > 0 and times.step > 0
    else:
        assert times is None
