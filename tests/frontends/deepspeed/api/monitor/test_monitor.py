"""`deepspeed.monitor`: `MonitorMaster(get_monitor_config(config))` writes a script's own
events to the monitors the config enables (CSV here: the engine's writer and format),
on rank 0; unknown keys in a block are refused; `enabled` says whether any is on."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shardwise.frontends.deepspeed.api.monitor.config import get_monitor_config
from shardwise.frontends.deepspeed.api.monitor.monitor import MonitorMaster


def test_script_events_go_to_the_enabled_monitors(tmp_path):
    config = {"train_batch_size": 8, "csv_monitor": {"enabled": True, "output_path": str(tmp_path),
                                                     "job_name": "run"}}
    monitor = MonitorMaster(get_monitor_config(config))
    assert monitor.enabled and monitor.monitor_config.csv_monitor.job_name == "run"
    monitor.write_events([("Train/Samples/eval_loss", 2.5, 8), ("Train/Samples/eval_loss", 2.0, 16)])
    monitor.close()
    assert (tmp_path / "run" / "Train_Samples_eval_loss.csv").read_text().splitlines() == [
        "step,eval_loss", "8,2.5", "16,2.0"]


def test_disabled_and_unknown_keys():
    assert not get_monitor_config({}).enabled
    assert not MonitorMaster(get_monitor_config({"tensorboard": {"enabled": False}})).enabled
    with pytest.raises(ValidationError, match="no_such_key"):
        get_monitor_config({"wandb": {"enabled": True, "no_such_key": 1}})
