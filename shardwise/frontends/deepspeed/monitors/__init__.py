"""DeepSpeed's monitors (the config's `tensorboard`, `csv_monitor`, `wandb` and `comet`
blocks): the series DeepSpeed's engine writes, written by rank 0 after every optimizer
step of an engine built from a DeepSpeed config (frontends/deepspeed/engine.py)."""

from shardwise.frontends.deepspeed.monitors.master import Event, MonitorMaster, step_events

__all__ = ["Event", "MonitorMaster", "step_events"]
