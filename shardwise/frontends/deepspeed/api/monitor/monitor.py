"""`deepspeed.monitor.monitor`: `MonitorMaster(monitor_config)`, every monitor the config
enables (TensorBoard, Weights & Biases, CSV, Comet), built and written on rank 0 only;
`write_events([(tag, value, step), ...])` writes each event to each of them. The writers
are the engine's own (frontends/deepspeed/monitors/): the same files and series names
as the engine's `Train/Samples/...` events."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch.distributed as dist

from shardwise.frontends.deepspeed.monitors import Event
from shardwise.frontends.deepspeed.monitors import MonitorMaster as EngineMonitors

__all__ = ["Monitor", "MonitorMaster"]


class Monitor(ABC):
    """DeepSpeed's base of a monitor: built from its config block, writes event lists."""

    @abstractmethod
    def __init__(self, monitor_config: Any) -> None:
        self.monitor_config = monitor_config

    @abstractmethod
    def write_events(self, event_list: list[tuple[str, float, int]]) -> None:
        ...


class MonitorMaster(Monitor):
    """`monitor_config`: `deepspeed.monitor.config.get_monitor_config(config_dict)` (or any
    object with the four blocks and `enabled`)."""

    def __init__(self, monitor_config: Any) -> None:
        super().__init__(monitor_config)
        self.enabled = monitor_config.enabled
        self._monitors = EngineMonitors(monitor_config, dist.get_rank() if dist.is_initialized() else 0)

    def write_events(self, event_list: list[tuple[str, float, int]]) -> None:
        self._monitors.write_events([Event(*event) for event in event_list])

    def close(self) -> None:
        """Flush and close the writers (DeepSpeed leaves them to the interpreter's exit)."""
        self._monitors.close()
