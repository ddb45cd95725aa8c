"""The arithmetic behind an estimate, as text: each formula, then the same formula with the
numbers substituted, then the result, so a reader can check the recommendation by hand."""

from __future__ import annotations

from shardwise.planner.formulas import (
    GB,
    LOGITS_BYTES,
    MASTER_WEIGHT_BYTES,
    Device,
    RecomputeMode,
    StateTerm,
    element_bytes,
    layer_activation_coefficients,
    model_state_terms,
)
from shardwise.planner.results import Estimate, OptionEstimate

DEVICE_NAMES: dict[Device, str] = {"gpu": "GPU", "cpu": "CPU", "nvme": "NVMe"}
CAPACITY_FLAGS: dict[Device, str] = {"gpu": "--gpu-memory", "cpu": "--cpu-memory", "nvme": "--nvme"}


def format_bytes(num_bytes: float) -> str:
    """Decimal units (GB = 1e9 bytes, as in the ZeRO paper); one decimal below 100."""
    if num_bytes == 0:
        return "0"
    for unit, scale in (("GB", GB), ("MB", 10**6), ("KB", 10**3)):
        if num_bytes >= scale:
            value = num_bytes / scale
            return f"{value:.0f} {unit}" if round(value, 1) >= 100 else f"{value:.1f} {unit}"
    return f"{num_bytes:.0f} B"


def format_count(count: int) -> str:
    """7500000000 → 7.5e9 when that is exact, otherwise digits with separators."""
    short = f"{count:.4g}"
    if "e" in short and float(short) == count:
        mantissa, exponent = short.split("e")
        return f"{mantissa}e{int(exponent)}"
    return f"{count:,}"


def render_terms(terms: list[StateTerm], num_params: int, world_size: int) -> tuple[str, str]:
    """('params 2Ψ + grads 2Ψ + optimizer 12Ψ/N', '2 × 7.5e9 + 2 × 7.5e9 + 12 × 7.5e9 / 64')."""
    if not terms:
        return "0", "0"
    symbolic, substituted = [], []
    psi = format_count(num_params)
    for term in terms:
        per_rank = "/N" if term.sharded else ""
        symbolic.append(f"{term.label} {term.bytes_per_param}Ψ{per_rank}")
        divide = f" / {world_size}" if term.sharded else ""
        substituted.append(f"{term.bytes_per_param} × {psi}{divide}")
    return " + ".join(symbolic), " + ".join(substituted)


def explain(estimate: Estimate) -> list[str]:
    """Inputs, usable memory, activation formulas, rejected options, the recommendation."""
    lines = [_inputs_line(estimate), _headroom_line(estimate)]
    lines += _activation_lines(estimate)
    lines.append(_gather_line(estimate))
    recommendation = estimate.recommendation
    if estimate.ruled_out:
        lines.append("Tried in order of preference:")
        lines += [f"  {option.label}: {_why_not(estimate, option)}" for option in estimate.ruled_out]
    if recommendation is None:
        lines.append(
            "Nothing fits. Add GPUs, host memory (--cpu-memory) or NVMe (--nvme), or shorten the sequence or micro-batch."
        )
        return lines
    lines.append(f"Recommended: {recommendation.label}.")
    lines += _placement_lines(estimate, recommendation.option, recommendation.recompute)
    return lines


def _inputs_line(estimate: Estimate) -> str:
    hw = estimate.hardware
    k, p = estimate.optimizer_state_bytes, element_bytes(estimate.dtype)
    if p == MASTER_WEIGHT_BYTES:
        k_parts = f"optimizer states {k}; the fp32 weights are their own master copy"
    else:
        k_parts = f"fp32 master copy {MASTER_WEIGHT_BYTES} + optimizer states {k - MASTER_WEIGHT_BYTES}"
    return (
        f"{estimate.shape.describe()}; N = {hw.num_gpus} data-parallel ranks on {hw.num_nodes} node(s) "
        f"of up to {hw.gpus_per_node} GPUs; {estimate.dtype} params and grads ({p} bytes each), "
        f"{estimate.optimizer}: K = {k} bytes/parameter ({k_parts})."
    )


def _headroom_line(estimate: Estimate) -> str:
    hw = estimate.hardware
    parts = []
    for device, unit in (("gpu", "per GPU"), ("cpu", "per node"), ("nvme", "per node")):
        capacity = hw.capacity_bytes(device)
        if capacity:
            parts.append(f"{DEVICE_NAMES[device]} {format_bytes(capacity)} → {format_bytes(hw.usable_bytes(device))} {unit}")
        else:
            parts.append(f"{DEVICE_NAMES[device]} none")
    return (
        f"Usable = capacity × (1 − {hw.headroom:g}), headroom for fragmentation, the CUDA context "
        f"and allocator caching: " + ", ".join(parts) + "."
    )


def _activation_lines(estimate: Estimate) -> list[str]:
    shape = estimate.shape
    if estimate.activations is None:
        return ["Activations not counted: only Ψ is known (give --hf-config, --preset, or --hidden-size/--layers/--heads)."]
    s, b, e = estimate.seq_len, estimate.micro_batch, element_bytes(estimate.dtype)
    h, layers, a, vocab = shape.hidden_size, shape.num_layers, shape.num_heads, shape.vocab_size
    c_h, c_a = layer_activation_coefficients(estimate.dtype)
    full_sym, full_num = f"s·b·h·({c_h} + {c_a}·a·s/h)", f"{s} × {b} × {h} × ({c_h} + {c_a} × {a} × {s} / {h})"
    logits_sym = f" + {LOGITS_BYTES}·s·b·V" if vocab else ""
    logits_num = f" + {LOGITS_BYTES} × {s} × {b} × {vocab}" if vocab else ""
    formulas: dict[RecomputeMode, tuple[str, str]] = {
        "none": (f"L·{full_sym}", f"{layers} × {full_num}"),
        "selective": (f"L·s·b·h·{c_h}", f"{layers} × {s} × {b} × {h} × {c_h}"),
        "full": (f"L·{e}·s·b·h + {full_sym}", f"{layers} × {e} × {s} × {b} × {h} + {full_num}"),
    }
    lines = [
        f"Activations per GPU (Korthikanti et al. 2022; s = {s}, b = {b}; selective recomputes the attention "
        f"core; full keeps each layer's input and recomputes one layer at a time in backward):"
    ]
    for mode, (symbolic, substituted) in formulas.items():
        total = format_bytes(estimate.activations[mode])
        lines.append(f"  {mode}: {symbolic}{logits_sym} = {substituted}{logits_num} = {total}")
    return lines


def _gather_line(estimate: Estimate) -> str:
    largest = estimate.shape.largest_layer_params
    if not largest:
        return "Stage-3 gather working set not counted: the largest layer is unknown."
    p = element_bytes(estimate.dtype)
    gather = estimate.option(3).gather_bytes
    return (
        f"Stage-3 working set per GPU = 3 × {p} × {largest:,} (largest block or embedding: its gathered "
        f"parameters, the next one's prefetched, its full gradient before reduce-scatter) = {format_bytes(gather)}."
    )


def _why_not(estimate: Estimate, option: OptionEstimate) -> str:
    hw = estimate.hardware
    if option.shortfall in ("cpu", "nvme"):
        device = option.shortfall
        need = option.cpu_per_node if device == "cpu" else option.nvme_per_node
        if hw.capacity_bytes(device) == 0:
            return f"{DEVICE_NAMES[device]} needs {format_bytes(need)} per node and none was given ({CAPACITY_FLAGS[device]})"
        return f"{DEVICE_NAMES[device]} needs {format_bytes(need)} per node > {format_bytes(hw.usable_bytes(device))} usable"
    if option.fits_with is not None:
        return f"fits only with {option.fits_with} recomputation"
    least = min(option.gpu_total(estimate.activation(mode)) for mode in (estimate.activations or {"none": 0}))
    return f"GPU needs at least {format_bytes(least)} > {format_bytes(hw.usable_bytes('gpu'))} usable"


def _placement_lines(estimate: Estimate, option: OptionEstimate, recompute: RecomputeMode) -> list[str]:
    hw, psi, n = estimate.hardware, estimate.shape.num_params, estimate.hardware.num_gpus
    terms = model_state_terms(option.stage, option.offload, estimate.dtype, estimate.optimizer_state_bytes)
    gpu_sym, gpu_num = render_terms([t for t in terms if t.device == "gpu"], psi, n)
    activations = estimate.activation(recompute)
    total = option.gpu_total(activations)
    activation_label = recompute if estimate.activations is not None else "not counted"
    lines = [
        f"  GPU model states = {gpu_sym} = {gpu_num} = {format_bytes(option.gpu_model_states)}",
        f"  GPU total = model states {format_bytes(option.gpu_model_states)} + stage-3 working set "
        f"{format_bytes(option.gather_bytes)} + activations ({activation_label}) {format_bytes(activations)} "
        f"= {format_bytes(total)} ≤ {format_bytes(hw.usable_bytes('gpu'))} usable",
    ]
    for device, per_node in (("cpu", option.cpu_per_node), ("nvme", option.nvme_per_node)):
        device_terms = [t for t in terms if t.device == device]
        if device_terms:
            sym, num = render_terms(device_terms, psi, n)
            lines.append(
                f"  {DEVICE_NAMES[device]} per node = ranks × ({sym}) = {hw.ranks_per_node} × ({num}) = "
                f"{format_bytes(per_node)} ≤ {format_bytes(hw.usable_bytes(device))} usable"
            )
    return lines
