"""Per-step metrics, written twice: JSON lines for scripts, TensorBoard events for people.

`metrics.jsonl` holds one object per optimizer step (see `step_record`); the report and
the plots are drawn from it after the run, so anything shown can be recomputed from the
file. TensorBoard gets the same numbers as scalars grouped by kind (train/, time/,
memory/, comm/, perf/).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardwise.tools.profiling import StepTimes
from shardwise.tools.train.run_files import METRICS_FILE

MB = 1e6


def step_record(
    step: int,
    *,
    loss: float,
    lr: float,
    grad_norm: float | None,
    tokens: int,
    times: StepTimes,
    mfu: float,
    memory: dict[str, int],
    comm_bytes: dict[str, int],
) -> dict[str, Any]:
    """One line of metrics.jsonl. `tokens` is the step's global token count; `memory`
    holds the engine's model-state bytes per category plus the process's own use."""
    return {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": tokens,
        "tokens_per_s": tokens / times.step if times.step > 0 else 0.0,
        "mfu": mfu,
        "time_s": times.as_dict(),
        "memory": memory,
        "comm_bytes": comm_bytes,
    }


class MetricsLog:
    """Appends step records to `<run_dir>/metrics.jsonl` and TensorBoard events in `run_dir`."""

    def __init__(self, run_dir: str | Path, *, continue_after: int = 0):
        """`continue_after`: a resumed run's checkpoint step; the records up to it are
        kept, those after it (written before the run stopped) are replaced."""
        from torch.utils.tensorboard import SummaryWriter

        self.path = Path(run_dir) / METRICS_FILE
        kept = [record for record in read_metrics(run_dir) if record["step"] <= continue_after] \
            if continue_after and self.path.is_file() else []
        self._file = self.path.open("w")
        for record in kept:
            self._file.write(json.dumps(record) + "\n")
        self._writer = SummaryWriter(log_dir=str(run_dir))

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        step, add = record["step"], self._writer.add_scalar
        add("train/loss", record["loss"], step)
        add("train/lr", record["lr"], step)
        if record["grad_norm"] is not None:
            add("train/grad_norm", record["grad_norm"], step)
        add("perf/tokens_per_s", record["tokens_per_s"], step)
        add("perf/mfu", record["mfu"], step)
        for phase, seconds in record["time_s"].items():
            add(f"time/{phase}_s", seconds, step)
        for category, nbytes in record["memory"].items():
            add(f"memory/{category}_MB", nbytes / MB, step)
        for op, nbytes in record["comm_bytes"].items():
            add(f"comm/{op}_MB", nbytes / MB, step)

    def close(self) -> None:
        self._file.close()
        self._writer.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The step records of a finished (or running) run."""
    with (Path(run_dir) / METRICS_FILE).open() as file:
        return [json.loads(line) for line in file if line.strip()]
