"""The arithmetic behind an estimate, as text: each formula, then the same formula with the
numbers substituted, then the result, so a reader can check the recommendation by hand."""

from __future__ import annotations

from shardwise.formulas.memory import (
    GB,
    MASTER_WEIGHT_BYTES,
    Device,
    RecomputeMode,
    StateTerm,
    element_bytes,
    frozen_state_term,
    model_state_terms,
)
from shardwise.formulas.layers import LOGITS_BYTES, layer_activation_coefficients
from shardwise.formulas.stages import partitions_parameters
from shardwise.tools.planner.optimizers import planned_optimizer
from shardwise.tools.planner.results import Estimate, OptionEstimate

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
    # no option partitions the parameters with pipeline parallelism or a 1-bit optimizer
    if any(partitions_parameters(option.stage) for option in estimate.options):
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
    lines.append(f"Recommended: {recommendation.label}.{_policy_config(recommendation.recompute)}")
    lines += _placement_lines(estimate, recommendation.option, recommendation.recompute)
    return lines


def _policy_config(recompute: RecomputeMode) -> str:
    """The config that turns the recommended recomputation on (shardwise's policy key)."""
    if recompute == "none":
        return ""
    return ' Config: "activation_checkpointing": {"policy": "' + recompute + '"}.'



def explain_with_suggestion(estimate: Estimate) -> list[str]:
    """`explain`, then, when ZeRO alone needs offload or does not fit, the tensor-parallel
    size that fits without offload and its arithmetic."""
    lines = explain(estimate)
    suggestion = estimate.tensor_suggestion
    if suggestion is None:
        return lines
    alone = ("does not fit" if estimate.recommendation is None
             else f"needs {estimate.recommendation.option.offload.label}")
    t = suggestion.parallel.tensor
    lines.append(f"Tensor parallelism: ZeRO alone {alone}. Inside a node, --tp {t} --megatron-sp "
                 f"(tensor_parallel.size {t}, sequence_parallel true) fits without offload:")
    lines.append("  " + _tensor_params_line(suggestion))
    lines += ["  " + line for line in _activation_lines(suggestion)[1:]]
    recompute = suggestion.recommendation.recompute
    lines.append(f"  Recommended at T = {t}: {suggestion.recommendation.label}.{_policy_config(recompute)}")
    lines += _placement_lines(suggestion, suggestion.recommendation.option, suggestion.recommendation.recompute)
    return lines


def _tensor_params_line(estimate: Estimate) -> str:
    """Ψ_T, the parameters of one tensor rank, and N = GPUs / T."""
    shape, t = estimate.shape, estimate.parallel.tensor
    replicated = shape.replicated_params
    layers, hidden = shape.num_layers, shape.hidden_size
    kept = (f"Ψ_r = (2L + 1)·h = (2 × {layers} + 1) × {hidden} = {replicated:,} replicated (norms)"
            if replicated else "Ψ_r = 0 (layout unknown: every parameter counted as split)")
    return (f"Ψ_T = ⌈(Ψ − Ψ_r)/T⌉ + Ψ_r = ⌈({format_count(shape.num_params)} − {replicated:,}) / {t}⌉ + "
            f"{replicated:,} = {format_count(estimate.params_per_rank)} per tensor rank, {kept}; ZeRO shards "
            f"over N = GPUs / T = {estimate.hardware.num_gpus} / {t} = {estimate.zero_ranks} ranks.")


def _inputs_line(estimate: Estimate) -> str:
    hw = estimate.hardware
    k, p = estimate.optimizer_state_bytes, element_bytes(estimate.dtype)
    if estimate.bf16_masters:
        k_parts = f"bf16 optimizer states {k}; the bf16 weights are their own master copy (bf16 masters)"
    elif p == MASTER_WEIGHT_BYTES:
        k_parts = f"optimizer states {k}; the fp32 weights are their own master copy"
    else:
        k_parts = f"fp32 master copy {MASTER_WEIGHT_BYTES} + optimizer states {k - MASTER_WEIGHT_BYTES}"
    parallel = estimate.parallel
    if parallel.tensor > 1:
        ulysses = f" (data × S = {parallel.sequence} Ulysses sequence ranks)" if parallel.sequence > 1 else ""
        ranks = (f"T = {parallel.tensor} tensor-parallel ranks" + (" with Megatron sequence parallelism"
                 if parallel.megatron_sp else "") + f" × N = {estimate.zero_ranks} ZeRO ranks{ulysses}")
    elif parallel.sequence > 1:
        ranks = f"N = {hw.num_gpus} ZeRO ranks (data × S = {parallel.sequence} Ulysses sequence ranks)"
    else:
        ranks = f"N = {hw.num_gpus} data-parallel ranks"
    if parallel.pipeline > 1:
        ranks = (f"P = {parallel.pipeline} pipeline stages, each holding ⌈Ψ_T / P⌉ = "
                 f"{format_count(estimate.params_per_rank)} parameters (ZeRO-3 is not offered with pipeline "
                 f"parallelism), × {ranks.replace(f'N = {hw.num_gpus}', f'N = {estimate.zero_ranks}')}")
    held = (f"{estimate.dtype} params ({p} bytes each) and grads summed in {estimate.grad_accum_dtype} "
            f"({element_bytes(estimate.grad_accum_dtype)} bytes each)" if estimate.grad_accum_dtype
            else f"{estimate.dtype} params and grads ({p} bytes each)")
    return (
        f"{estimate.shape.describe()}; {ranks} on {hw.num_nodes} node(s) "
        f"of up to {hw.gpus_per_node} GPUs; {held}, "
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
    t, s_size, sp = estimate.parallel.tensor, estimate.parallel.sequence, estimate.parallel.megatron_sp
    outside = 4 * e + 2
    if t > 1 and not sp:  # the norm, dropout and column-input regions stay whole
        linear_sym, linear_num = f"({outside} + {c_h - outside}/T", f"({outside} + {c_h - outside} / {t}"
    elif t > 1:
        linear_sym, linear_num = f"({c_h}/T", f"({c_h} / {t}"
    else:
        linear_sym, linear_num = f"({c_h}", f"({c_h}"
    split_sym = "/(h·T)" if t > 1 else "/h"
    split_num = f" / ({h} × {t})" if t > 1 else f" / {h}"
    per_s_sym, per_s_num = ("/S", f" / {s_size}") if s_size > 1 else ("", "")
    full_sym = f"s·b·h·{linear_sym} + {c_a}·a·s{split_sym}){per_s_sym}"
    full_num = f"{s} × {b} × {h} × {linear_num} + {c_a} × {a} × {s}{split_num}){per_s_num}"
    input_div_sym = ("/T" if sp else "") + per_s_sym
    input_div_num = (f" / {t}" if sp else "") + per_s_num
    if t > 1:  # the kept input (split by T with SP), QKV and MLP-up outputs split by T, row-parallel outputs whole
        outputs_sym, outputs_num = f"(1{'/T' if sp else ''} + 7/T + 2)", f"(1{f' / {t}' if sp else ''} + 7 / {t} + 2)"
        selective_kept = (f"{e}·s·b·h·{outputs_sym}{per_s_sym}", f"{e} × {s} × {b} × {h} × {outputs_num}{per_s_num}")
    else:
        selective_kept = (f"{e}·s·b·h·(1 + 9){per_s_sym}", f"{e} × {s} × {b} × {h} × (1 + 9){per_s_num}")
    vocab_sym = "/T" if t > 1 else ""
    vocab_num = f" / {t}" if t > 1 else ""
    logits_sym = f" + {LOGITS_BYTES}·s·b·V{vocab_sym}" if vocab else ""
    logits_num = f" + {LOGITS_BYTES} × {s} × {b} × {vocab}{vocab_num}" if vocab else ""
    formulas: dict[RecomputeMode, tuple[str, str]] = {
        "none": (f"L·{full_sym}", f"{layers} × {full_num}"),
        "selective": (f"(L − 1)·{selective_kept[0]} + {full_sym}", f"{layers - 1} × {selective_kept[1]} + {full_num}"),
        "full": (f"(L − 1)·{e}·s·b·h{input_div_sym} + {full_sym}",
                 f"{layers - 1} × {e} × {s} × {b} × {h}{input_div_num} + {full_num}"),
    }
    lines = [
        f"Activations per GPU (Korthikanti et al. 2022; s = {s}, b = {b}; activation_checkpointing.policy: "
        f"full keeps each layer's input, selective also its linear layers' outputs (9 of h wide: QKV, attention "
        f"projection, MLP up and down), and backward recomputes one layer at a time, shardwise/formulas/activation.py):"
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
    t = estimate.parallel.tensor
    if t > 1:
        largest_text = f"⌈{largest:,} / {t}⌉"
    else:
        largest_text = f"{largest:,}"
    return (
        f"Stage-3 working set per GPU = 3 × {p} × {largest_text} (largest block or embedding: its gathered "
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
    hw, psi, n = estimate.hardware, estimate.params_per_rank, estimate.zero_ranks
    terms = model_state_terms(option.stage, option.offload, estimate.dtype, estimate.optimizer_state_bytes,
                              planned_optimizer(estimate.optimizer).state_terms, grad_dtype=estimate.grad_accum_dtype)
    gpu_sym, gpu_num = _with_frozen(render_terms([t for t in terms if t.device == "gpu"], psi, n), estimate, option,
                                    "gpu")
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
            sym, num = _with_frozen(render_terms(device_terms, psi, n), estimate, option, device)
            lines.append(
                f"  {DEVICE_NAMES[device]} per node = ranks × ({sym}) = {hw.ranks_per_node} × ({num}) = "
                f"{format_bytes(per_node)} ≤ {format_bytes(hw.usable_bytes(device))} usable"
            )
    return lines


def _with_frozen(rendered: tuple[str, str], estimate: Estimate, option: OptionEstimate, device: str) -> tuple[str, str]:
    """The formula with the frozen parameters' term added where they live (Ψ_f per rank)."""
    if not estimate.frozen_per_rank:
        return rendered
    term = frozen_state_term(option.stage, option.offload, estimate.dtype)
    if term.device != device:
        return rendered
    divide = ("/N", f" / {estimate.zero_ranks}") if term.sharded else ("", "")
    return (f"{rendered[0]} + {term.label} {term.bytes_per_param}Ψ_f{divide[0]}",
            f"{rendered[1]} + {term.bytes_per_param} × {format_count(estimate.frozen_per_rank)}{divide[1]}")
