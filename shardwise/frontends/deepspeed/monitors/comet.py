"""Comet: an experiment started on rank 0 with the block's keys (`online` false: an offline
experiment, written to disk for `comet upload`), each series logged at most once every
`samples_log_interval` samples, as DeepSpeed's monitor does. Without the comet_ml package
the block is skipped with a warning, so a config written for a machine that has it still
trains here."""

from __future__ import annotations

import logging

from shardwise.frontends.deepspeed.config.schema import CometConfig
from shardwise.frontends.deepspeed.monitors.master import Event

log = logging.getLogger("shardwise")


def comet_monitor(config: CometConfig) -> CometMonitor | None:
    try:
        import comet_ml
    except ImportError:
        log.warning("comet.enabled is true but the comet_ml package is not installed: nothing is logged to Comet "
                    "(pip install 'shardwise[monitors]' or comet_ml)")
        return None
    return CometMonitor(config, comet_ml)


class CometMonitor:
    def __init__(self, config: CometConfig, comet_ml: object):
        self.experiment = comet_ml.start(api_key=config.api_key, project=config.project, workspace=config.workspace,
                                         experiment_key=config.experiment_key, mode=config.mode, online=config.online)
        if config.experiment_name is not None:
            self.experiment.set_name(config.experiment_name)
        self.interval = config.samples_log_interval
        self.last_logged: dict[str, int] = {}

    def write_events(self, events: list[Event]) -> None:
        for event in events:
            last = self.last_logged.get(event.name)
            if last is None or event.samples - last >= self.interval:
                self.last_logged[event.name] = event.samples
                self.experiment.log_metric(event.name, event.value, step=event.samples)

    def close(self) -> None:
        self.experiment.end()
