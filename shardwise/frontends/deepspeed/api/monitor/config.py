"""`deepspeed.monitor.config`: the config's four monitor blocks as one object
(`get_monitor_config(config_dict)`), as DeepSpeed 0.19.8 builds it for `MonitorMaster`:
each block is the section shardwise's config reads (frontends/deepspeed/config/schema.py:
the same keys and defaults, unknown keys refused), and `enabled` says whether any is on."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from shardwise.frontends.deepspeed.config.schema import CometConfig, CsvMonitorConfig, TensorBoardConfig, WandbConfig

__all__ = ["CSVConfig", "CometConfig", "DeepSpeedMonitorConfig", "TensorBoardConfig", "WandbConfig",
           "get_monitor_config"]

CSVConfig = CsvMonitorConfig  # DeepSpeed's name for the csv_monitor block
MONITOR_BLOCKS = ("tensorboard", "wandb", "csv_monitor", "comet")


class DeepSpeedMonitorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    csv_monitor: CsvMonitorConfig = Field(default_factory=CsvMonitorConfig)

    @property
    def enabled(self) -> bool:
        return self.tensorboard.enabled or self.wandb.enabled or self.csv_monitor.enabled or self.comet.enabled


def get_monitor_config(param_dict: dict[str, Any]) -> DeepSpeedMonitorConfig:
    """The monitor blocks of a DeepSpeed config dict (the rest of it is not read)."""
    return DeepSpeedMonitorConfig(**{block: param_dict.get(block, {}) for block in MONITOR_BLOCKS})
