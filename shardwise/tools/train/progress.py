"""The live progress bar rank 0 draws while training.

On a terminal it is a rich progress bar redrawn in place; when output goes to a file or
a pipe (CI, pytest) a redrawn bar would be noise, so the same fields are printed as one
line every `print_every` steps instead.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

MB = 1e6


def describe_step(record: dict[str, Any]) -> dict[str, str]:
    """The progress fields of a metrics record, formatted."""
    memory = record["memory"]
    states = memory["params"] + memory["grads"] + memory["optimizer_states"]
    return {
        "loss": f"{record['loss']:.3f}",
        "tokens_per_s": f"{record['tokens_per_s']:,.0f}",
        "mfu": f"{record['mfu']:.1%}",
        "memory": f"{states / MB:,.1f} MB states, {memory['process_current'] / MB:,.0f} MB process",
    }


class TrainingProgress:
    """`with TrainingProgress(total, console) as progress: progress.update(record)`."""

    def __init__(self, total_steps: int, console: Console, print_every: int | None):
        """`print_every`: the config's `steps_per_print`; None prints the first and last steps
        only, a value below 1 every step (as DeepSpeed reads them)."""
        self.total_steps = total_steps
        self.console = console
        self.print_every = max(1, print_every if print_every is not None else total_steps)
        self.live = console.is_terminal
        self._progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(bar_width=24),
            TextColumn("loss [bold]{task.fields[loss]}[/]"),
            TextColumn("{task.fields[tokens_per_s]} tok/s"),
            TextColumn("MFU {task.fields[mfu]}"),
            TextColumn("{task.fields[memory]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            disable=not self.live,
        )
        blank = {"loss": "-", "tokens_per_s": "-", "mfu": "-", "memory": "-"}
        self._task = self._progress.add_task("train", total=total_steps, **blank)

    def update(self, record: dict[str, Any]) -> None:
        fields = describe_step(record)
        self._progress.update(self._task, completed=record["step"], **fields)
        step = record["step"]
        if not self.live and (step % self.print_every == 0 or step in (1, self.total_steps)):
            self.console.print(
                f"step {step}/{self.total_steps}  loss {fields['loss']}  {fields['tokens_per_s']} tok/s  "
                f"MFU {fields['mfu']}  {fields['memory']}  step {record['time_s']['step']:.2f}s",
                highlight=False,
                soft_wrap=True,
            )

    def __enter__(self) -> "TrainingProgress":
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()
