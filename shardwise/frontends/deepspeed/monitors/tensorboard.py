"""TensorBoard: scalar events under `output_path/job_name` (output_path "" means the
current directory, as in DeepSpeed), flushed after every step so a reader sees them live."""

from __future__ import annotations

import os

from shardwise.frontends.deepspeed.config.schema import TensorBoardConfig
from shardwise.frontends.deepspeed.monitors.master import Event


class TensorBoardMonitor:
    def __init__(self, config: TensorBoardConfig):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.path.join(config.output_path, config.job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events: list[Event]) -> None:
        for event in events:
            self.writer.add_scalar(event.name, event.value, event.samples)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
