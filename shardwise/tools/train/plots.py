"""PNG figures of a run, drawn from its files with matplotlib's headless Agg backend.

- loss.png: training loss per step (validation loss at the end) and the learning rate.
- memory.png: model states per rank, measured beside the formulas, and process memory over steps.
- zero_stages.png (--compare-stages): the ZeRO paper's figure 1 from a real run: bytes
  per rank of parameters, gradients and optimizer states at each stage, measured beside
  the formula, and the bytes each rank sends per step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from shardwise.tools.train.expected import COLLECTIVES, MODEL_STATES  # noqa: E402

MB = 1e6
COLOURS = {
    "params": "#4C72B0",
    "grads": "#DD8452",
    "optimizer_states": "#55A868",
    "buffers": "#8C8C8C",
    "all_reduce": "#8172B3",
    "all_gather": "#4C72B0",
    "reduce_scatter": "#C44E52",
}


def plot_loss(records: list[dict[str, Any]], val_loss: float, path: Path) -> None:
    steps = [r["step"] for r in records]
    figure, loss_axis = plt.subplots(figsize=(8, 4.5))
    loss_axis.plot(steps, [r["loss"] for r in records], color="#4C72B0", label="training loss")
    loss_axis.scatter([steps[-1]], [val_loss], color="#C44E52", zorder=3, label=f"validation loss {val_loss:.3f}")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("cross-entropy (nats per byte)")
    lr_axis = loss_axis.twinx()
    lr_axis.plot(steps, [r["lr"] for r in records], color="#8C8C8C", linestyle="--", label="learning rate")
    lr_axis.set_ylabel("learning rate")
    handles = loss_axis.get_legend_handles_labels()[0] + lr_axis.get_legend_handles_labels()[0]
    loss_axis.legend(handles=handles, loc="upper right")
    loss_axis.set_title("Training loss")
    loss_axis.grid(alpha=0.3)
    _save(figure, path)


def plot_memory(records: list[dict[str, Any]], summary: dict[str, Any], path: Path) -> None:
    figure, (states_axis, time_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    memory = summary["memory"]
    categories = [*MODEL_STATES, "buffers"]
    positions = range(len(categories))
    measured = [memory["measured"][c] / MB for c in categories]
    formula = [memory["formula"].get(c, 0) / MB for c in categories]
    width = 0.38
    states_axis.bar([p - width / 2 for p in positions], measured, width, label="measured",
                    color=[COLOURS[c] for c in categories])
    states_axis.bar([p + width / 2 for p in positions], formula, width, label="formula",
                    color="white", edgecolor=[COLOURS[c] for c in categories], hatch="//")
    states_axis.set_xticks(list(positions), categories)
    states_axis.set_ylabel("MB per rank")
    run = summary["run"]
    states_axis.set_title(f"Model states per rank (ZeRO-{run['stage']}, N = {run['world_size']}, {run['dtype']})")
    states_axis.legend()

    steps = [r["step"] for r in records]
    process_label = f"process ({summary['run']['process_memory']}), current"
    time_axis.plot(steps, [r["memory"]["process_current"] / MB for r in records], label=process_label)
    time_axis.plot(steps, [r["memory"]["process_peak"] / MB for r in records], linestyle="--", label="peak")
    model_states = [sum(r["memory"][c] for c in MODEL_STATES) / MB for r in records]
    time_axis.plot(steps, model_states, label="model states (engine ledger)")
    time_axis.set_xlabel("step")
    time_axis.set_ylabel("MB (rank 0)")
    time_axis.set_ylim(bottom=0)
    time_axis.set_title("Memory over the run")
    time_axis.legend()
    time_axis.grid(alpha=0.3)
    _save(figure, path)


def plot_stage_comparison(comparison: dict[str, Any], path: Path) -> None:
    figure, (memory_axis, comm_axis) = plt.subplots(1, 2, figsize=(13, 5))
    stages = [entry["stage"] for entry in comparison["stages"]]
    width = 0.38
    _stacked_pairs(memory_axis, comparison["stages"], "memory", MODEL_STATES, width)
    memory_axis.set_title(
        f"Model states per rank: Ψ = {comparison['num_params'] / 1e6:.2f}M, N = {comparison['world_size']}, "
        f"{comparison['dtype']}, K = {comparison['optimizer_state_bytes']}"
    )
    memory_axis.set_ylabel("MB per rank")
    _stacked_pairs(comm_axis, comparison["stages"], "comm_per_step", COLLECTIVES, width)
    comm_axis.set_title("Bytes sent per rank per step")
    comm_axis.set_ylabel("MB per rank per step")
    for axis in (memory_axis, comm_axis):
        axis.set_xticks(stages, [f"stage {s}\nmeasured | formula" for s in stages])
        axis.legend(fontsize=8)
        axis.grid(axis="y", alpha=0.3)
    _save(figure, path)


def _stacked_pairs(axis, entries: list[dict[str, Any]], key: str, parts: tuple[str, ...], width: float) -> None:
    """Per stage, a solid stacked bar (measured) beside a hatched one (formula)."""
    for offset, source, style in ((-width / 2, "measured", {}), (width / 2, "formula", {"hatch": "//", "alpha": 0.55})):
        bottoms = [0.0] * len(entries)
        for part in parts:
            heights = [entry[key][source][part] / MB for entry in entries]
            axis.bar(
                [entry["stage"] + offset for entry in entries], heights, width, bottom=bottoms,
                color=COLOURS[part], edgecolor="black", linewidth=0.4,
                label=f"{part} ({source})", **style,
            )
            bottoms = [b + h for b, h in zip(bottoms, heights)]


def _save(figure, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
