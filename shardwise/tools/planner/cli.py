"""`shardwise estimate`: memory per ZeRO stage and offload option, and what to run (with a
tensor or sequence group when --tp / --sp are given, or a suggested --tp when ZeRO alone
does not fit), and the predicted step time and tokens/s of every option that fits.

The time model (shardwise/formulas/step_time.py) prices on a datasheet device (--device),
or on a profile of this machine (--measure PATH writes one and uses it; --speed-profile
PATH reuses it); --mfu and the link flags override either.

Imports the planner (plain arithmetic), rich, and the optimizer registry for K, which
imports torch (shardwise/runtime/optim/registry.py says why).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.table import Table

from shardwise.tools.planner.explain import DEVICE_NAMES, format_bytes
from shardwise.formulas.memory import ELEMENT_BYTES, NO_OFFLOAD
from shardwise.formulas.step_time import Speeds
from shardwise.tools.planner.devices import DATASHEETS, datasheet, load_profile, with_overrides
from shardwise.tools.planner.timing import Prediction, price_options
from shardwise.formulas.parallel_activation import ModelParallel
from shardwise.tools.planner.optimizers import optimizer_names
from shardwise.tools.planner.recommend import DEFAULT_HEADROOM, Estimate, Hardware, OptionEstimate, estimate
from shardwise.formulas.model_shape import ModelShape
from shardwise.models.shapes import PRESETS, preset_shape, shape_from_hf_config

# Narrower consoles (pipes, CI logs) would squeeze the table into wrapped cells.
MIN_WIDTH = 120

LAYOUT_FLAGS = ("--hidden-size", "--layers", "--heads", "--vocab-size")
HARDWARE_FLOAT_FLAGS = {
    "--gpu-memory": "GB per GPU, e.g. 80",
    "--cpu-memory": "GB per node, e.g. 512",
    "--nvme": "GB per node, 0 for none",
    "--headroom": f"a fraction in [0, 1), e.g. {DEFAULT_HEADROOM}",
}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "estimate",
        help="memory per GPU and node for every ZeRO stage and offload option, and a recommendation",
        description=__doc__.splitlines()[0],
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--params", type=float, help="parameter count, e.g. 7.5e9")
    source.add_argument("--hf-config", metavar="PATH", help="Hugging Face config.json (or its directory)")
    source.add_argument("--preset", choices=list(PRESETS), help="a built-in model shape")

    layout = parser.add_argument_group("layout for --params (enables the activation estimate)")
    layout.add_argument("--hidden-size", type=int)
    layout.add_argument("--layers", type=int)
    layout.add_argument("--heads", type=int)
    layout.add_argument("--vocab-size", type=int)

    hardware = parser.add_argument_group("hardware")
    hardware.add_argument("--gpus", type=int, default=1, help="total GPUs = data-parallel size (default 1)")
    hardware.add_argument("--gpus-per-node", type=int, default=8, help="default 8")
    hardware.add_argument("--gpu-memory", type=float, default=80.0, metavar="GB", help="per GPU (default 80)")
    hardware.add_argument("--cpu-memory", type=float, default=512.0, metavar="GB", help="per node (default 512)")
    hardware.add_argument("--nvme", type=float, default=0.0, metavar="GB", help="per node, 0 = none (default)")
    hardware.add_argument(
        "--headroom", type=float, default=DEFAULT_HEADROOM, help=f"fraction held back (default {DEFAULT_HEADROOM})"
    )

    training = parser.add_argument_group("training")
    training.add_argument("--micro-batch", type=int, default=1, help="per GPU (default 1)")
    training.add_argument("--seq-len", type=int, default=2048, help="default 2048")
    training.add_argument("--dtype", choices=list(ELEMENT_BYTES), default="bf16", help="default bf16")
    training.add_argument("--optimizer", choices=optimizer_names(), default="adam", help="default adam")
    training.add_argument("--bf16-masters", action="store_true",
                          help="bf16 master weights, gradients and optimizer states (config: bf16."
                               "bf16_master_weights_and_grads and bf16_optimizer_states; needs --dtype bf16)")
    training.add_argument("--grad-accum-dtype", choices=["fp32"], default=None,
                          help="sum micro-batch gradients in fp32 beside a 16-bit --dtype: 4-byte gradient buffers "
                               "(config: data_types.grad_accum_dtype; stages 1-3)")
    training.add_argument("--trainable-params", type=float, default=None, metavar="COUNT",
                          help="parameters that train (e.g. LoRA adapters, 4.2e7); the rest is frozen: its 16-bit "
                               "weights only, partitioned at stage 3 (default: every parameter trains)")

    parallel = parser.add_argument_group("model parallelism (--gpus counts every GPU; ZeRO shards over GPUs / tp)")
    parallel.add_argument("--tp", type=int, default=1, help="tensor_parallel.size (default 1: the estimate then "
                          "suggests a size when ZeRO alone needs offload or does not fit)")
    parallel.add_argument("--megatron-sp", action="store_true",
                          help="Megatron sequence parallelism inside the tensor group (tensor_parallel.sequence_parallel)")
    parallel.add_argument("--sp", type=int, default=1, help="Ulysses sequence_parallel.size (default 1)")
    parallel.add_argument("--pp", type=int, default=1, help="pipeline_parallel.size (default 1): each stage holds "
                          "1/pp of the layers; ZeRO shards over GPUs / (tp × pp)")

    timing = parser.add_argument_group("time model (step time and tokens/s of each option that fits)")
    speed = timing.add_mutually_exclusive_group()
    speed.add_argument("--device", choices=list(DATASHEETS), default="h100",
                       help="datasheet speeds of this GPU (default h100)")
    speed.add_argument("--speed-profile", metavar="PATH", help="speeds measured by --measure")
    speed.add_argument("--measure", metavar="PATH", help="measure this machine (one gloo rank per core, about "
                       "half a minute), write the profile to PATH and price on it")
    timing.add_argument("--mfu", type=float, help="achievable fraction of peak FLOP/s (default: the device's)")
    timing.add_argument("--intra-bandwidth", type=float, metavar="GB/s", help="per GPU inside a node, each way")
    timing.add_argument("--inter-bandwidth", type=float, metavar="GB/s", help="per GPU between nodes, each way")
    timing.add_argument("--intra-latency", type=float, metavar="µs", help="per message inside a node")
    timing.add_argument("--inter-latency", type=float, metavar="µs", help="per message between nodes")
    timing.add_argument("--accumulation", type=int, default=1,
                        help="micro-batches per step (gradient_accumulation_steps; the pipeline's m), default 1")
    parser.set_defaults(handler=main)
    return parser


def speeds_from_args(args: argparse.Namespace, shape: ModelShape | None = None) -> Speeds:
    """The speeds the flags name: measured now (the MFU on `shape`'s layout when known), a
    saved profile, or a datasheet, with overrides."""
    if args.measure:
        from shardwise.tools.planner.measure import ProbeShape, measure

        probe = ProbeShape()
        if shape is not None and shape.has_layout:
            probe = ProbeShape(shape.hidden_size, shape.num_heads, args.seq_len, args.micro_batch,
                               shape.vocab_size or probe.vocab)
        speeds = measure(args.measure, probe=probe)
    elif args.speed_profile:
        speeds = load_profile(args.speed_profile)
    else:
        speeds = datasheet(args.device)
    return with_overrides(speeds, mfu=args.mfu, intra_bandwidth=args.intra_bandwidth,
                          inter_bandwidth=args.inter_bandwidth, intra_latency=args.intra_latency,
                          inter_latency=args.inter_latency)


def main(args: argparse.Namespace) -> int:
    try:
        _check_hardware(args)
        result = estimate(
            _with_trainable(_shape(args), args.trainable_params),
            Hardware(args.gpus, args.gpus_per_node, args.gpu_memory, args.cpu_memory, args.nvme, args.headroom),
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
            dtype=args.dtype,
            optimizer=args.optimizer,
            parallel=ModelParallel(args.tp, args.sp, args.megatron_sp, args.pp),
            bf16_masters=args.bf16_masters,
            grad_accum_dtype=args.grad_accum_dtype,
        )
        if args.accumulation <= 0:
            raise ValueError(f"--accumulation {args.accumulation} must be a positive number of micro-batches")
        speeds = speeds_from_args(args, result.shape)
        predictions = price_options(result, speeds, accumulation=args.accumulation) if result.shape.has_layout else []
    except (ValueError, FileNotFoundError) as error:
        print(f"shardwise estimate: error: {error}", file=sys.stderr)
        return 2
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = max(console.width, MIN_WIDTH)
    render(result, console)
    render_times(result, speeds, predictions, console)
    return 0


def _shape(args: argparse.Namespace) -> ModelShape:
    layout = (args.hidden_size, args.layers, args.heads, args.vocab_size)
    if args.params is None and any(value is not None for value in layout):
        raise ValueError("--hidden-size/--layers/--heads/--vocab-size go with --params; presets and configs carry their own")
    if args.preset:
        return preset_shape(args.preset)
    if args.hf_config:
        return shape_from_hf_config(args.hf_config)
    _check_params(args.params)
    for flag, value in zip(LAYOUT_FLAGS, layout, strict=True):
        if value is not None and value <= 0:
            raise ValueError(f"{flag} {value} must be a positive integer")
    if args.hidden_size and args.heads and args.hidden_size % args.heads:
        raise ValueError(f"--hidden-size {args.hidden_size} is not divisible by --heads {args.heads}: each "
                         "attention head gets hidden-size / heads dimensions")
    return ModelShape.from_params(args.params, *layout)


def _with_trainable(shape: ModelShape, count: float | None) -> ModelShape:
    if count is None:
        return shape
    if not math.isfinite(count) or not count.is_integer() or not 0 < count <= shape.num_params:
        raise ValueError(f"--trainable-params {count:g} must be a whole number between 1 and the model's "
                         f"{shape.num_params:,} parameters")
    return replace(shape, trainable_params=int(count))


def _check_params(count: float) -> None:
    """argparse reads --params as a float (so 7.5e9 works), which also lets inf and nan in."""
    if not math.isfinite(count) or count <= 0:
        raise ValueError(f"--params {count:g} is not a parameter count: give the model's number of "
                         "parameters, a positive finite number such as 7.5e9")
    if not count.is_integer():
        raise ValueError(f"--params {count:g} is not a whole number of parameters: give e.g. 7.5e9")


def _check_hardware(args: argparse.Namespace) -> None:
    """NaN passes every range check (each comparison is false), so finiteness is checked first."""
    for flag, expected in HARDWARE_FLOAT_FLAGS.items():
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if not math.isfinite(value):
            raise ValueError(f"{flag} {value:g} is not a finite number: give {expected}")


def render(result: Estimate, console: Console) -> None:
    """The first explanation line states the inputs, so it heads the output; the
    arithmetic follows the tables it justifies."""
    console.print(result.explanation[0], markup=False)
    console.print(_options_table(result))
    if result.activations is not None:
        console.print(_activations_table(result))
    for line in result.explanation[1:]:
        console.print(line, markup=False)


def _options_table(result: Estimate) -> Table:
    chosen = result.recommendation.option if result.recommendation else None
    table = Table(
        title="Model states per GPU; host memory and NVMe per node (GB = 1e9 bytes)",
        caption=("◀ recommended; " if chosen else "") + "gather = stage-3 working set per GPU",
    )
    for name in ("stage", "offload", "GPU states", "gather", "CPU/node", "NVMe/node", "fits"):
        table.add_column(name, justify="left" if name in ("offload", "fits") else "right", no_wrap=True)
    for option in result.options:
        table.add_row(
            str(option.stage),
            option.offload.label,
            format_bytes(option.gpu_model_states),
            format_bytes(option.gather_bytes),
            format_bytes(option.cpu_per_node),
            format_bytes(option.nvme_per_node),
            _fit_text(option) + (" ◀" if option == chosen else ""),
            style="bold green" if option == chosen else None,
        )
    return table


def _fit_text(option: OptionEstimate) -> str:
    if option.shortfall is not None:
        return f"no ({DEVICE_NAMES[option.shortfall]})"
    return "yes" if option.fits_with == "none" else f"{option.fits_with} recompute"


def render_times(result: Estimate, speeds: Speeds, predictions: list[Prediction], console: Console) -> None:
    """The step-time table, fastest first, and the speeds it assumed."""
    if not result.shape.has_layout:
        console.print("Step time: not predicted (the time model needs the layout: --hidden-size, --layers, --heads)")
        return
    if not predictions:
        return
    table = Table(title=f"Predicted step time on {speeds.name} (fastest first)",
                  caption="comm = communication left after overlap; update = the optimizer step, with fp32 "
                  "gradient sums where --grad-accum-dtype fp32 (docs/formulas.md#step-time)")
    for name in ("option", "recompute", "step", "tokens/s", "compute", "bubble", "comm", "update", "offload"):
        table.add_column(name, justify="left" if name in ("option", "recompute") else "right", no_wrap=True)
    for prediction in sorted(predictions, key=lambda p: p.step_s):
        time, plan = prediction.time, prediction.plan
        label = f"stage {plan.stage}" + ("" if plan.offload == NO_OFFLOAD else f" + {plan.offload.label}")
        table.add_row(label, plan.recompute, format_seconds(time.total), f"{prediction.tokens_per_s:,.0f}",
                      *(format_seconds(value) for value in (time.compute, time.bubble, time.exposed_comm,
                                                            time.optimizer + time.accumulation, time.offload)))
    console.print(table)
    console.print(f"Speeds: {speeds.peak_flops / 1e12:g} TFLOP/s peak × MFU {speeds.mfu:.2f}; memory "
                  f"{speeds.memory_bandwidth / 1e9:g} GB/s; links intra {speeds.intra_node.bandwidth / 1e9:g} GB/s, "
                  f"{speeds.intra_node.latency_s * 1e6:g} µs, inter {speeds.inter_node.bandwidth / 1e9:g} GB/s, "
                  f"{speeds.inter_node.latency_s * 1e6:g} µs; PCIe {speeds.pcie_bandwidth / 1e9:g} GB/s, NVMe "
                  f"{speeds.nvme_bandwidth / 1e9:g} GB/s per node; overlap {speeds.overlap:g} "
                  f"({speeds.source or 'flags'})", markup=False)


def format_seconds(seconds: float) -> str:
    if seconds == 0:
        return "0"
    return f"{seconds * 1e3:.3g}ms" if seconds < 1 else f"{seconds:.3g}s"


def _activations_table(result: Estimate) -> Table:
    table = Table(title="Activations per GPU")
    table.add_column("recomputation")
    table.add_column(f"s = {result.seq_len}, b = {result.micro_batch}", justify="right")
    for mode, value in (result.activations or {}).items():
        table.add_row(mode, format_bytes(value))
    return table
