"""The main job's activation memory beside the formulas, and what recomputation re-gathers
at ZeRO stage 3 (C9).

The ranks call `activation_summary` after training: the engine's saved-tensor accounting
(`memory_breakdown()["activations"]`, split by ActivationTracker into what layers keep,
checkpoints and the recomputation working set, each at its peak) next to the planner's
formulas for the same GPT, micro-batch and policy (shardwise/formulas/activation.py), and
at stage 3 the unit gathers made by recomputations (GatherSchedule.recompute_gathers)
next to the policy's count. The parent process prints them from summary.json with
`activation_table` and `regather_note`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.table import Table

from shardwise.runtime.activation.policy import RecomputePolicy
from shardwise.formulas.activation import (
    LayerShape,
    activation_peak_bytes,
    checkpoint_bytes,
    head_bytes,
    layer_activation_bytes,
    selective_kept_bytes,
)
from shardwise.formulas.communication import recompute_gather_bytes
from shardwise.formulas.memory import element_bytes
from shardwise.tools.train.setup import DTYPE_NAMES

if TYPE_CHECKING:
    from shardwise.runtime.engine import Engine

MB = 1e6
KINDS = ("checkpoints", "recompute", "saved", "total")
LABELS = {
    "checkpoints": "checkpoints (kept inputs, selective's kept outputs)",
    "recompute": "recomputation working set",
    "saved": "kept by layers not checkpointed, and the head",
    "total": "activations (joint peak, device)",
}


def layer_shape(engine: "Engine", seq_len: int) -> LayerShape:
    """The GPT layer the engine trains: fused attention keeps no a·s² scores, except on
    CPU with dropout (the unfused path, with masks in the activation dtype)."""
    config, tensor = engine.module.config, engine.config.tensor_parallel
    e = element_bytes(DTYPE_NAMES[engine.dtype])
    cpu, dropout = engine.device.type == "cpu", config.dropout > 0
    return LayerShape(seq_len, engine.config.train_micro_batch_size_per_gpu, config.n_embd, config.n_head, e,
                      mask_bytes=e if cpu else 1, dropout=dropout, attention_core=dropout and cpu,
                      tensor_parallel=tensor.size, sequence_parallel=tensor.sequence_parallel)


def activation_summary(engine: "Engine", seq_len: int, steps: int) -> dict[str, Any]:
    """Measured and formula bytes per kind, layers re-run per step, and stage-3 re-gathers."""
    block = engine.config.activation_checkpointing
    policy = RecomputePolicy(block.policy, block.every_k)
    num_layers = engine.module.config.n_layer
    layer = layer_shape(engine, seq_len)
    regions = policy.regions(num_layers)
    partitioned = block.partition_activations and layer.tensor_parallel > 1
    covered = sum(len(region) for region in regions)
    cached = selective_kept_bytes(layer) if policy.name == "selective" else 0
    full, head = layer_activation_bytes(layer), head_bytes(layer, engine.module.config.vocab_size)
    longest = max((len(region) for region in regions), default=0)
    formula = {
        "checkpoints": len(regions) * checkpoint_bytes(layer, partitioned) + covered * cached,
        "recompute": longest * full - (0 if partitioned or not regions else checkpoint_bytes(layer)),
        "saved": (num_layers - covered) * full + head,
        "total": activation_peak_bytes(layer, num_layers, regions, partitioned, cached, head),
    }
    tracker = engine.activations
    accumulation = engine.gradient_accumulation_steps
    summary = {
        "policy": policy.name + (f" (k = {policy.every_k})" if policy.name == "every_k" else ""),
        "layer": {"seq_len": layer.seq_len, "micro_batch": layer.micro_batch, "hidden": layer.hidden,
                  "heads": layer.heads, "element_bytes": layer.element_bytes, "layers": num_layers,
                  "layer_bytes": full, "head_bytes": head, "regions": len(regions)},
        "measured": {**tracker.breakdown(), "layers_per_step": tracker.recomputed_layers / steps},
        "formula": {**formula, "layers_per_step": accumulation * covered},
        "regather": None,
    }
    schedule = getattr(engine.zero.params, "schedule", None)
    if schedule is not None and regions:
        summary["regather"] = _regather(engine, schedule, accumulation * covered, steps)
    return summary


def _regather(engine: "Engine", schedule: Any, layers_per_step: int, steps: int) -> dict[str, Any]:
    """Unit gathers by recomputations per step, measured and from the policy: the layers it
    re-runs × the units of one layer (the first block's, all blocks being alike)."""
    first = set(engine.module.blocks[0].modules())
    units = [unit for module, owned in schedule.module_units.items() if module in first for unit in owned]
    layer_params = sum(unit.numel for unit in units)
    p = element_bytes(DTYPE_NAMES[engine.dtype])
    return {
        "units_per_step": schedule.recompute_gathers / steps,
        "formula_units_per_step": layers_per_step * len(units),
        "units_per_layer": len(units),
        "layers_per_step": layers_per_step,
        "layer_params": layer_params,
        "bytes_per_step": recompute_gather_bytes(layer_params, layers_per_step, p, engine.world_size),
    }


def activation_table(summary: dict[str, Any]) -> Table:
    activations = summary["activations"]
    layer, measured, formula = activations["layer"], activations["measured"], activations["formula"]
    table = Table(
        title=f"Activations per rank: policy {activations['policy']}, {layer['layers']} layers, s = {layer['seq_len']}, "
        f"b = {layer['micro_batch']}, h = {layer['hidden']}, e = {layer['element_bytes']}; one layer keeps "
        f"{layer['layer_bytes']:,} B without recomputation, the head {layer['head_bytes']:,} B "
        "(shardwise/formulas/activation.py)",
        title_justify="left",
    )
    for name, justify in (("kind", "left"), ("measured", "right"), ("formula", "right"), ("difference", "right")):
        table.add_column(name, justify=justify, no_wrap=name == "kind")
    for kind in KINDS:
        table.add_row(LABELS[kind], _megabytes(measured[kind]), _megabytes(formula[kind]),
                      _relative(measured[kind], formula[kind]))
    table.add_row("layers re-run per step", f"{measured['layers_per_step']:g}", f"{formula['layers_per_step']:g}",
                  _relative(measured["layers_per_step"], formula["layers_per_step"]))
    return table


def regather_note(summary: dict[str, Any]) -> str | None:
    """One line on stage 3's gathers in recomputations, when there were any to make."""
    regather = summary["activations"]["regather"] if "activations" in summary else None
    if regather is None:
        return None
    return (
        f"ZeRO-3 recomputation re-gathered {regather['units_per_step']:g} parameter units per step (formula: "
        f"{regather['layers_per_step']} layers re-run × {regather['units_per_layer']} units = "
        f"{regather['formula_units_per_step']}, {regather['bytes_per_step'] / MB:,.3f} MB of ring all-gather for "
        f"{regather['layer_params']:,} parameters per layer); each layer's backward then uses them without gathering "
        "again, so recomputation adds no all-gather bytes to the formula's term above."
    )


def _megabytes(nbytes: float) -> str:
    return f"{nbytes / MB:,.3f} MB"


def _relative(measured: float, formula: float) -> str:
    if measured == formula:
        return "[green]exact[/]"
    if formula == 0:
        return f"{measured:+,.0f}"
    share = measured / formula - 1
    colour = "green" if abs(share) <= 0.1 else "yellow"
    return f"[{colour}]{share:+.1%}[/]"
