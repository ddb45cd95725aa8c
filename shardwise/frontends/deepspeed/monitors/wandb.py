"""Weights & Biases: `wandb.init(project, group, entity=team)` on rank 0 and one
`wandb.log({series: value}, step=samples)` per event, as DeepSpeed's monitor does. Without a
network, `WANDB_MODE=offline` writes the run under `./wandb` for `wandb sync` later."""

from __future__ import annotations

from shardwise.frontends.deepspeed.config.schema import WandbConfig
from shardwise.frontends.deepspeed.monitors.master import Event


class WandbMonitor:
    def __init__(self, config: WandbConfig):
        try:
            import wandb
        except ImportError:
            raise ImportError("the config's wandb block is enabled but the wandb package is not installed: "
                              "pip install 'shardwise[monitors]' (or wandb), or set wandb.enabled false") from None
        self.wandb = wandb
        self.run = wandb.init(project=config.project, group=config.group, entity=config.team)

    def write_events(self, events: list[Event]) -> None:
        for event in events:
            self.run.log({event.name: event.value}, step=event.samples)

    def close(self) -> None:
        self.run.finish()
