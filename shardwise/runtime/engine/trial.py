"""One autotuning trial inside a training run: measure a few steps, write the metrics, exit.

DeepSpeed's autotuner runs the user's unmodified script once per candidate config; the
script never knows. The engine does the rest (DeepSpeed's `_autotuning_exit`): it times
the steps start_step..end_step (0-based, as DeepSpeed counts them: with 3..5, steps 4 to
6 of the run), rank 0 writes the metrics to `metric_path` as JSON, and every rank exits
after the last of them, so a trial costs only its warm-up and the measured steps.

The time is the wall clock of whole steps, the script's own work between them (data,
logging) included: what the user's run will actually see. `latency` is seconds per
optimizer step, `throughput` samples per second (train_batch_size / latency).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TrialPolicy:
    """DeepSpeed's `autotuning` block when enabled: where the metrics go and which steps count."""

    metric_path: str
    start_step: int = 3
    end_step: int = 5
    train_batch_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.start_step <= self.end_step:
            raise ValueError(f"autotuning steps {self.start_step}..{self.end_step}: need 0 <= start <= end")


class TrialMeter:
    """Called after every optimizer step with the number of steps done."""

    def __init__(self, policy: TrialPolicy, *, writes: bool):
        self.policy = policy
        self.writes = writes  # rank 0 writes, as DeepSpeed's print_json_dist([0]) does
        self._started: float | None = None

    def after_step(self, steps_done: int) -> None:
        """Start the clock when step `start_step` (0-based) begins; after step `end_step`
        ends, write the metrics and exit the process."""
        if steps_done == self.policy.start_step:
            self._started = time.perf_counter()
        if steps_done != self.policy.end_step + 1:
            return
        assert self._started is not None  # start_step <= end_step, so the clock started
        measured = self.policy.end_step - self.policy.start_step + 1
        latency = (time.perf_counter() - self._started) / measured
        if self.writes:
            metrics = {"latency": latency, "throughput": self.policy.train_batch_size / latency,
                       "steps_measured": measured}
            path = Path(self.policy.metric_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(metrics) + "\n")
            print(f"shardwise: autotuning trial wrote its metrics to {path.resolve()}", flush=True)
        sys.exit(0)
