"""DeepSpeed's CSV monitor: one file per series under `output_path/job_name`, named after
the series with '/' and ' ' as '_' (`Train_Samples_lr.csv`), a header row `step,<last part
of the name>` and then one `samples,value` row per step."""

from __future__ import annotations

import csv
import os
from pathlib import Path

from shardwise.frontends.deepspeed.config.schema import CsvMonitorConfig
from shardwise.frontends.deepspeed.monitors.master import Event


class CsvMonitor:
    def __init__(self, config: CsvMonitorConfig):
        self.log_dir = Path(os.path.join(config.output_path, config.job_name))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.started: set[str] = set()

    def path_of(self, name: str) -> Path:
        return self.log_dir / f"{name.replace('/', '_').replace(' ', '_')}.csv"

    def write_events(self, events: list[Event]) -> None:
        for event in events:
            path = self.path_of(event.name)
            with path.open("a", newline="") as file:
                writer = csv.writer(file)
                if event.name not in self.started:
                    self.started.add(event.name)
                    writer.writerow(["step", event.name.split("/")[-1]])
                writer.writerow([event.samples, event.value])

    def close(self) -> None:
        """Every row is written when it comes."""
