"""Optimizers passed to initialize() as objects keep their own state codec: a checkpoint of
factored (Adafactor), quantised (8-bit Adam) or mixed (Muon) state saves, reshards and
resumes like one built from the config."""

import pytest

from shardwise.tools.testing import run_distributed
from tests.runtime.checkpoint.workers import Run, train_run
from tests.runtime.zero.workers import Case, relative_error, train_reference


@pytest.mark.parametrize(("optimizer", "tolerance"), [("adafactor", 1e-5), ("adam8bit", 1e-3), ("muon", 1e-5)])
def test_object_optimizer_state_is_checkpointed_and_resharded(optimizer, tolerance, tmp_path):
    rows, lr = 8, 1e-2
    saved = run_distributed(train_run, 2, Run(Case(stage=2, optimizer=optimizer, lr=lr), rows=rows, steps=1,
                                             save_dir=str(tmp_path)))[0]
    resumed = run_distributed(train_run, 1, Run(Case(stage=0, optimizer=optimizer, lr=lr), rows=rows, first_step=1,
                                               load_dir=str(tmp_path)))[0]
    expected = train_reference(Case(steps=3, micro_batch=rows, lr=lr, optimizer=optimizer), world_size=1)
    for step, got in enumerate(saved["losses"] + resumed["losses"]):
        assert abs(got - expected["losses"][step]) / expected["losses"][step] < tolerance, step
    for name, want in expected["params"].items():
        assert relative_error(resumed["params"][name], want) < tolerance, name
