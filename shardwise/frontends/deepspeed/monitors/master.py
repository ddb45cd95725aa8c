"""The events of one optimizer step and the monitors that write them.

DeepSpeed 0.19.8's engine writes, on rank 0 after each optimizer step, `Train/Samples/lr`
(the rate the next step will use: the schedule has already stepped) and, with fp16,
`Train/Samples/loss_scale`; its pipeline engine writes `Train/Samples/train_loss`. Each is
a (name, value, global samples) event: the x axis is the number of samples trained, which
grows by train_batch_size per step, skipped steps included. shardwise writes all three
for every engine (the train loss is the mean of rank 0's micro-batch losses of the step),
to every monitor the config enables; ranks other than 0 build none and write nothing.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from shardwise.frontends.deepspeed.config.schema import ShardwiseConfig


class Event(NamedTuple):
    name: str
    value: float
    samples: int


class Monitor(Protocol):
    def write_events(self, events: list[Event]) -> None: ...

    def close(self) -> None: ...


def step_events(*, samples: int, lr: float | None, loss: float | None, loss_scale: float | None) -> list[Event]:
    """The series of one step, named as DeepSpeed names them."""
    events = []
    if loss is not None:
        events.append(Event("Train/Samples/train_loss", loss, samples))
    if lr is not None:
        events.append(Event("Train/Samples/lr", lr, samples))
    if loss_scale is not None:
        events.append(Event("Train/Samples/loss_scale", loss_scale, samples))
    return events


class MonitorMaster:
    """Every monitor the config enables, on rank 0 (each imports its package only when enabled)."""

    def __init__(self, config: ShardwiseConfig, rank: int):
        self.monitors: list[Monitor] = []
        if rank != 0:
            return
        if config.tensorboard.enabled:
            from shardwise.frontends.deepspeed.monitors.tensorboard import TensorBoardMonitor

            self.monitors.append(TensorBoardMonitor(config.tensorboard))
        if config.csv_monitor.enabled:
            from shardwise.frontends.deepspeed.monitors.csv_monitor import CsvMonitor

            self.monitors.append(CsvMonitor(config.csv_monitor))
        if config.wandb.enabled:
            from shardwise.frontends.deepspeed.monitors.wandb import WandbMonitor

            self.monitors.append(WandbMonitor(config.wandb))
        if config.comet.enabled:
            from shardwise.frontends.deepspeed.monitors.comet import comet_monitor

            monitor = comet_monitor(config.comet)
            if monitor is not None:
                self.monitors.append(monitor)

    @property
    def enabled(self) -> bool:
        return bool(self.monitors)

    def write_events(self, events: list[Event]) -> None:
        for monitor in self.monitors:
            monitor.write_events(events)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()
        self.monitors = []
