"""The tables printed after a run: measured memory and communication beside the formulas
(docs/formulas.md#model-states-per-rank, docs/formulas.md#communication-per-step).

Drawn by the parent process from the files the ranks wrote (summary.json,
metrics.jsonl, zero_stages.json), so a finished run can be re-reported at any time.
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean
from typing import Any

from rich.console import Console
from rich.table import Table

from shardwise.formulas.memory import element_bytes
from shardwise.formulas.stages import partitions_parameters
from shardwise.tools.train.activation_report import activation_table, regather_note
from shardwise.tools.train.expected import COLLECTIVES, MODEL_STATES, ring_share
from shardwise.tools.train.metrics import read_metrics
from shardwise.tools.train.run_files import COMPARISON_FILE, SUMMARY_FILE

MB = 1e6
PHASES = ("forward", "backward", "comm_wait", "optimizer", "data")


def load_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def megabytes(nbytes: float) -> str:
    return f"{nbytes / MB:,.3f} MB"


def difference(measured: int, formula: int, tolerance: int) -> str:
    """measured − formula, labelled "exact" or "padding" when within the padding bound."""
    diff = measured - formula
    if diff == 0:
        return "[green]exact[/]"
    label = " [green](padding)[/]" if abs(diff) <= tolerance else ""
    return f"{diff:+,} B{label}"


def memory_table(summary: dict[str, Any]) -> Table:
    run, model, memory = summary["run"], summary["model"], summary["memory"]
    padding = summary["padding_elements"]
    p, k = element_bytes(run["dtype"]), run["optimizer_state_bytes"]
    per_element = {"params": p, "grads": p, "optimizer_states": k}
    persistent = summary["persistent_params"]
    table = Table(
        title=f"Model states per rank: ZeRO-{run['stage']}, Ψ = {model['num_params']:,}, N = {run['world_size']}, "
        f"{run['dtype']}, K = {k}" + (" (bf16 masters and optimizer states)" if run.get("bf16_masters") else "")
        + (f", P = {persistent:,} persistent" if persistent else "") + _experts_title(summary),
        title_justify="left",
    )
    _add_columns(table, "category")
    for category in MODEL_STATES:
        measured, formula = memory["measured"][category], memory["formula"][category]
        table.add_row(
            category, megabytes(measured), megabytes(formula), memory["expressions"][category],
            difference(measured, formula, padding * per_element[category]),
        )
    measured_total = sum(memory["measured"][c] for c in MODEL_STATES)
    formula_total = sum(memory["formula"][c] for c in MODEL_STATES)
    table.add_row(
        "[bold]model states[/]", megabytes(measured_total), megabytes(formula_total), "",
        difference(measured_total, formula_total, padding * (2 * p + k)), end_section=True,
    )
    table.add_row(
        "buffers", megabytes(memory["measured"]["buffers"]), "—",
        "transient (Cb)", "",
    )
    return table


def _experts_title(summary: dict[str, Any]) -> str:
    """The expert terms' quantities (docs/formulas.md#expert-parallelism), for an MoE run
    whose experts are trained apart (ep_size > 1)."""
    experts = summary.get("experts")
    if experts is None:
        return ""
    return (f"; experts Ψ_E = {experts['params']:,} of Ψ (Ψ_D = {summary['model']['num_params'] - experts['params']:,}"
            f"), P_E = {experts['ep_size']}, N_E = {summary['run']['world_size'] // experts['ep_size']}")


def comm_table(summary: dict[str, Any]) -> Table:
    run, comm = summary["run"], summary["comm_per_step"]
    measured, formula = comm["measured"], comm["formula"]
    experts = summary.get("experts")
    collectives = COLLECTIVES + ("all_to_all",) if experts is not None else COLLECTIVES
    tolerance = 3 * summary["padding_elements"] * element_bytes(run["dtype"])
    table = Table(
        title=f"Communication per rank per step (ring bytes sent, N = {run['world_size']}, "
        f"b = {element_bytes(run['comm_dtype'])} B gradients / {element_bytes(run['dtype'])} B parameters"
        + (f"; L_E = {experts['layers']} MoE layers"
           + (f" (L_R = {experts['recomputed_layers']} recomputed)" if experts.get("recomputed_layers") else "")
           + f", E = {experts['experts']}, C = {experts['capacity']}, d = {experts['width']}"
           if experts is not None else "") + ")",
        title_justify="left",
    )
    _add_columns(table, "collective")
    for op in collectives:
        table.add_row(
            op, megabytes(measured[op]), megabytes(formula[op]), comm["expressions"][op],
            difference(measured[op], formula[op], tolerance),
        )
    measured_total = sum(measured[op] for op in collectives)
    formula_total = sum(formula[op] for op in collectives)
    table.add_row(
        "[bold]total[/]", megabytes(measured_total), megabytes(formula_total), "",
        difference(measured_total, formula_total, tolerance), end_section=True,
    )
    table.add_row("control", f"{measured['control']:,} B", "—", "norm, checks, metrics", "")
    return table


def _add_columns(table: Table, first: str) -> None:
    table.add_column(first, no_wrap=True)
    table.add_column("measured", justify="right")
    table.add_column("formula", justify="right")
    table.add_column("term", no_wrap=True)
    table.add_column("difference", justify="right")


def tied_weight_note(stage: int, extra_gathered: int, tied_params: int, world_size: int, dtype: str) -> str | None:
    """Why stage 3 gathers more than the formula says, when the difference is whole
    re-gathers of the tied embedding: the formula assumes each parameter is used once per
    forward, but the GPT's embedding is also its output layer, so it is gathered again for
    its second use."""
    share = ring_share(tied_params, element_bytes(dtype), world_size)
    if not partitions_parameters(stage) or extra_gathered <= 0 or share == 0 or extra_gathered % share:
        return None
    count = extra_gathered // share
    return (
        f"all_gather exceeds the formula by {count} gather(s) of the tied embedding (wte = lm_head, "
        f"{tied_params:,} elements, {share:,} B each): it is used twice per forward, the formula counts one use."
    )


def timing_table(records: list[dict[str, Any]], summary: dict[str, Any]) -> Table:
    steady = records[1:] or records  # step 1 pays one-off costs (allocation, stage-3 trace)
    step_s = mean(r["time_s"]["step"] for r in steady)
    table = Table(title="Training", title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    final = summary["final"]
    table.add_row("loss (first step → last step)", f"{records[0]['loss']:.3f} → {final['loss']:.3f}")
    table.add_row("validation loss", f"{final['val_loss']:.3f}")
    table.add_row("tokens/s (mean after step 1)", f"{mean(r['tokens_per_s'] for r in steady):,.0f}")
    peak = summary["peak_flops_per_device"]
    table.add_row(
        "MFU (mean after step 1)",
        f"{mean(r['mfu'] for r in steady):.1%} of {peak['value'] / 1e9:,.1f} GFLOP/s per rank ({peak['source']})",
    )
    split = ", ".join(
        f"{phase.replace('_', ' ')} {mean(r['time_s'][phase] for r in steady) / step_s:.0%}" for phase in PHASES
    )
    table.add_row("step time (mean after step 1)", f"{step_s:.3f} s: {split}")
    table.add_row("training wall time", f"{summary['train_seconds']:.1f} s for {len(records)} steps")
    return table


def print_training_report(run_dir: Path, console: Console) -> None:
    summary = load_json(run_dir / SUMMARY_FILE)
    records = read_metrics(run_dir)
    console.print(timing_table(records, summary))
    console.print(memory_table(summary))
    if "activations" in summary:  # summaries written before activations were reported lack it
        console.print(activation_table(summary))
    console.print(comm_table(summary))
    comm = summary["comm_per_step"]
    notes = [tied_weight_note(
        summary["run"]["stage"],
        comm["measured"]["all_gather"] - comm["formula"]["all_gather"],
        summary["model"]["tied_params"],
        summary["run"]["world_size"],
        summary["run"]["dtype"],
    ), regather_note(summary)]
    for note in filter(None, notes):
        console.print(f"[dim]note: {note}[/]", highlight=False)


def comparison_table(comparison: dict[str, Any]) -> Table:
    table = Table(
        title=f"ZeRO stages, measured / formula MB per rank: GPT {comparison['model_size']}, "
        f"Ψ = {comparison['num_params']:,}, N = {comparison['world_size']}, {comparison['dtype']}, "
        f"K = {comparison['optimizer_state_bytes']}",
        title_justify="left",
    )
    table.add_column("stage", justify="right")
    for category in MODEL_STATES:
        table.add_column(category, justify="right")
    table.add_column("comm per step", justify="right")
    for entry in comparison["stages"]:
        memory, comm = entry["memory"], entry["comm_per_step"]
        cells = [f"{memory['measured'][c] / MB:,.2f} / {memory['formula'][c] / MB:,.2f}" for c in MODEL_STATES]
        measured_comm = sum(comm["measured"][op] for op in COLLECTIVES)
        formula_comm = sum(comm["formula"][op] for op in COLLECTIVES)
        table.add_row(str(entry["stage"]), *cells, f"{measured_comm / MB:,.2f} / {formula_comm / MB:,.2f}")
    return table


def print_comparison_report(run_dir: Path, console: Console) -> None:
    comparison = load_json(run_dir / COMPARISON_FILE)
    console.print(comparison_table(comparison))
    stage3 = next(entry for entry in comparison["stages"] if partitions_parameters(entry["stage"]))
    comm = stage3["comm_per_step"]
    note = tied_weight_note(
        stage3["stage"],
        comm["measured"]["all_gather"] - comm["formula"]["all_gather"],
        comparison["tied_params"],
        comparison["world_size"],
        comparison["dtype"],
    )
    if note:
        console.print(f"[dim]note: {note}[/]", highlight=False)
