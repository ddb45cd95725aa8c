"""Checkpoints of 1-bit Adam / LAMB: the moments (and 1-bit LAMB's per-parameter scalars
and fresh variance) are saved and resharded through the optimizer's codec; the per-rank
error-feedback buffers restart from zero, as DeepSpeed's do."""

from __future__ import annotations

import pytest

from shardwise.formulas.memory import onebit_state_bytes
from shardwise.runtime.optim import native
from shardwise.tools.testing import run_distributed
from tests.runtime.optim.onebit_reference import Exchange, OneBitSettings, Simulation
from tests.runtime.optim.test_onebit import STEPS, assert_equal_to, torch_path, train_engine, whole_state

SAVED_AT = 3  # freeze_step 2: one compressed step before the save


@pytest.mark.parametrize("algorithm", ["adam", "lamb"])
def test_resume_at_same_world_size_restarts_error_feedback(tmp_path, algorithm, monkeypatch):
    """Saved one step after the warm-up, resumed at 2 ranks: equal to the simulation whose
    error buffers restart from zero at the resume (on the torch path: `torch_path`)."""
    torch_path(monkeypatch)
    settings = OneBitSettings(algorithm, weight_decay=0.01)
    saved = run_distributed(train_engine, 2, settings, range(SAVED_AT), None, str(tmp_path))
    resumed = run_distributed(train_engine, 2, settings, range(SAVED_AT, STEPS), str(tmp_path))
    simulation = Simulation(settings, 2, saved[0]["order"], saved[0]["units"])
    simulation.train(range(SAVED_AT))
    simulation.adopt(whole_state(saved, "final"), tolerance=1e-5)
    simulation.exchange = Exchange(2, simulation.length)
    assert_equal_to(resumed[0], simulation.train(range(SAVED_AT, STEPS)), simulation.weights())


def test_resume_at_one_rank_continues_without_compression(tmp_path):
    """1-bit LAMB saved at 2 ranks, resumed at 1: the frozen variances, momentum, trust-ratio
    averages and factors carry over; one rank has nobody to exchange with, so the momentum
    is no longer compressed."""
    settings = OneBitSettings("lamb", weight_decay=0.01)
    saved = run_distributed(train_engine, 2, settings, range(SAVED_AT), None, str(tmp_path))
    resumed = run_distributed(train_engine, 1, settings, range(SAVED_AT, STEPS), str(tmp_path))[0]
    for result in saved:  # with the native kernels, the fused step keeps the last gathered signs, counted
        assert result["keeps_signs"] == native.enabled()
        assert result["optimizer_states"] == onebit_state_bytes(result["numel"], 2, lamb=True,
                                                                keeps_signs=result["keeps_signs"])
    assert resumed["volumes"][-1]["all_to_all"] == 0 and resumed["volumes"][-1]["all_reduce"] == 0
    simulation = Simulation(settings, 1, resumed["order"], resumed["units"])
    simulation.adopt(whole_state(saved, "final"), tolerance=None)
    assert_equal_to(resumed, simulation.train(range(SAVED_AT, STEPS)), simulation.weights())
