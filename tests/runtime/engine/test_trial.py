"""An autotuning trial inside a run (runtime/engine/trial.py): steps start..end (0-based)
timed, rank 0 writes the metrics, every rank exits after step end."""

import json
import time

import pytest

from shardwise.runtime.engine.trial import TrialMeter, TrialPolicy


def test_measures_the_profile_steps_then_exits(tmp_path):
    path = tmp_path / "out" / "metrics.json"
    meter = TrialMeter(TrialPolicy(str(path), start_step=1, end_step=2, train_batch_size=8), writes=True)
    meter.after_step(1)  # step 1 (0-based) begins: the clock starts
    time.sleep(0.02)
    meter.after_step(2)
    time.sleep(0.02)
    with pytest.raises(SystemExit) as stopped:
        meter.after_step(3)  # step 2 ended
    assert stopped.value.code == 0
    metrics = json.loads(path.read_text())
    assert metrics["steps_measured"] == 2
    assert 0.02 <= metrics["latency"] < 1.0
    assert metrics["throughput"] == pytest.approx(8 / metrics["latency"])


def test_other_ranks_exit_without_writing(tmp_path):
    meter = TrialMeter(TrialPolicy(str(tmp_path / "m.json"), 0, 0, 1), writes=False)
    meter.after_step(0)
    with pytest.raises(SystemExit):
        meter.after_step(1)
    assert not (tmp_path / "m.json").exists()


def test_refuses_steps_out_of_order():
    with pytest.raises(ValueError, match="need 0 <= start <= end"):
        TrialPolicy("m.json", 5, 3)
