"""Leftovers of failed runs and bad settings (reliability issue, item 5): a failed save's
partial directory does not survive the next save, whatever its tag; a bad collective
timeout is refused by name."""

import pytest

import shardwise
from shardwise.runtime.distributed.setup import collective_timeout
from tests.runtime.zero.workers import build_model, global_batch

CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def test_the_next_save_removes_partial_directories_of_any_tag(tmp_path):
    engine = shardwise.initialize(build_model("gpt"), CONFIG)
    x, y = global_batch(0, 2)
    engine.backward(engine(x, y))
    engine.step()
    killed = tmp_path / ".global_step7.partial"  # what a save killed mid-way leaves
    (killed / "rank_00000.json").parent.mkdir(parents=True)
    (killed / "rank_00000.json").write_text("{}")
    engine.save_checkpoint(tmp_path, tag="after")
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["after", "latest"]


@pytest.mark.parametrize("value", ["ten", "0", "-5", "nan", "inf", ""])
def test_a_bad_collective_timeout_is_named(monkeypatch, value):
    monkeypatch.setenv("SHARDWISE_COLLECTIVE_TIMEOUT", value)
    with pytest.raises(ValueError, match=f"SHARDWISE_COLLECTIVE_TIMEOUT='{value}' is not a timeout: give a "
                                         r"positive number of seconds \(default 600\)"):
        collective_timeout()


def test_a_good_collective_timeout_is_read(monkeypatch):
    monkeypatch.setenv("SHARDWISE_COLLECTIVE_TIMEOUT", "2.5")
    assert collective_timeout().total_seconds() == 2.5
