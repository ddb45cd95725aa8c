"""The per-step time split: phases exclude the collective waits inside them, which are
reported on their own, so the parts add up to the step."""

import time

import pytest
import torch

from shardwise.profiling import StepTimer, process_memory


class WaitClock:
    """Stands in for `engine.comm.wait_seconds`: seconds spent blocked on collectives."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def block(self, seconds: float) -> None:
        time.sleep(seconds)
        self.seconds += seconds


def test_comm_waits_are_moved_out_of_the_phase_they_happen_in():
    clock = WaitClock()
    timer = StepTimer(lambda: clock.seconds, torch.device("cpu"))
    timer.start_step()
    with timer.phase("forward"):
        time.sleep(0.02)
    with timer.phase("backward"):
        time.sleep(0.03)
        clock.block(0.05)
    with timer.phase("optimizer"):
        time.sleep(0.01)
    times = timer.end_step()
    assert times.comm_wait == pytest.approx(0.05)
    # Had the 0.05 s wait stayed in backward, it would read at least 0.08 s.
    assert 0.03 <= times.backward < 0.07
    assert times.forward >= 0.02 and times.optimizer >= 0.01
    parts = times.data + times.forward + times.backward + times.optimizer + times.comm_wait
    assert parts == pytest.approx(times.step, abs=0.02)
    assert set(times.as_dict()) == {"data", "forward", "backward", "optimizer", "comm_wait", "step"}


def test_phases_accumulate_over_micro_batches_and_reset_per_step():
    timer = StepTimer(lambda: 0.0, torch.device("cpu"))
    timer.start_step()
    for _ in range(3):
        with timer.phase("forward"):
            time.sleep(0.01)
    assert timer.end_step().forward >= 0.03
    timer.start_step()
    assert timer.end_step().forward == 0.0


def test_misuse_is_reported():
    timer = StepTimer(lambda: 0.0, torch.device("cpu"))
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
