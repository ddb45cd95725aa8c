"""`shardwise train`: the main job (docs/getting-started.md#the-main-job, C23).

With no arguments it trains the ≈10M-parameter GPT on the standard library's source, in
2 CPU processes (gloo) or one per GPU (NCCL), with ZeRO-3, for about two minutes on two
cores. This process checks the flags and the config, builds the corpus cache, starts the
ranks through torchrun (rank 0 draws the progress bar), and when they are done prints
the report and draws the plots from the files they wrote. Interrupted (SIGINT, SIGTERM,
SIGHUP), it lets the ranks finish their step and write a checkpoint, then says in one
line where the partial results are.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from shardwise.tools.launcher.interrupts import Interrupted, interruptible, raise_deferred_stop
from shardwise.tools.train.options import (
    DEFAULT_COMPARE_STEPS,
    DEFAULT_LR,
    DEFAULT_MODEL_SIZE,
    DEFAULT_SEED,
    DEFAULT_SEQ_LEN,
    DEFAULT_STAGE,
    DEFAULT_STEPS,
    MODEL_SIZES,
    RECOMPUTE_POLICIES,
    TrainOptions,
    apply_flags,
    auto_values,
    default_config,
    dtype_name,
    merge_config,
    optimizer_block,
    optimizer_names,
    optimizer_stage,
)
from shardwise.tools.train.run_files import (
    COMPARISON_FILE,
    COMPARISON_PLOT,
    CORPUS_CACHE_DIR,
    LOSS_PLOT,
    MEMORY_PLOT,
    CHECKPOINT_DIR,
    OPTIONS_FILE,
    SUMMARY_FILE,
    last_checkpoint,
)

REPORT_WIDTH = 120
EXAMPLES = """\
examples:
  shardwise train                                  ZeRO-3, GPT 10m, 2 CPU processes, ≈2 minutes
  shardwise train --stage 2 --steps 50 --bf16
  shardwise train --model-size 1m --nproc 4 --profile
  shardwise train --moe-experts 4 --moe-every 2 --ep-size 2    MoE GPT, experts split over 2 ranks
  shardwise train --config ds_config.json          a DeepSpeed config laid over the defaults
  shardwise train --optimizer onebitadam           1-bit Adam (ZeRO stage 2, warm-up 20% of the steps)
  shardwise train --activation-checkpointing full  recompute every layer; activation bytes vs the formulas
  shardwise train --compare-stages                 stages 0-3 side by side: zero_stages.png
  shardwise train --name r1 --resume --nproc 1     continue run r1 from its last checkpoint, on 1 process
Results go to OUT_DIR/NAME/: metrics.jsonl, loss.png, memory.png, TensorBoard events,
checkpoint/, sample.txt, summary.json (and profile/ with --profile).
Ctrl-C (or SIGTERM) stops after the current step and writes a checkpoint first; a second
Ctrl-C stops at once."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train",
        help="train a small GPT on built-in data with ZeRO; report memory, communication and speed",
        description="Train a GPT on a byte-level corpus of the Python standard library's source, on local "
        "processes, and report measured memory and communication beside the ZeRO formulas.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=None,
                        help=f"ZeRO stage (default: the config's, else {DEFAULT_STAGE})")
    parser.add_argument("--model-size", choices=MODEL_SIZES, default=DEFAULT_MODEL_SIZE,
                        help=f"GPT preset by parameter count (default: {DEFAULT_MODEL_SIZE})")
    parser.add_argument("--steps", type=_positive_int, default=None,
                        help=f"optimizer steps (default: {DEFAULT_STEPS}; {DEFAULT_COMPARE_STEPS} per stage "
                        "with --compare-stages)")
    parser.add_argument("--moe-experts", type=_positive_int, default=None, metavar="E",
                        help="make MLPs mixtures of E experts (see --moe-every, --moe-top-k, --ep-size; default: "
                        "every block dense)")
    parser.add_argument("--moe-top-k", type=int, choices=(1, 2), default=1, help="experts per token (default: 1)")
    parser.add_argument("--moe-every", type=_positive_int, default=1, metavar="N",
                        help="every N-th block is MoE (default: 1, every block)")
    parser.add_argument("--ep-size", type=_positive_int, default=1, metavar="P",
                        help="expert parallelism: each rank of a group of P holds E/P experts of each MoE block "
                        "(P divides E and --nproc; default: 1, every expert on every rank)")
    parser.add_argument("--nproc", type=_positive_int, default=None,
                        help="processes (default: one per CUDA device, or 2 without CUDA)")
    parser.add_argument("--seq-len", type=_positive_int, default=DEFAULT_SEQ_LEN,
                        help=f"bytes per training sequence, the model's context (default: {DEFAULT_SEQ_LEN})")
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="DeepSpeed JSON config laid over the defaults (batch, optimizer, scheduler, "
                        "zero_optimization, ...)")
    parser.add_argument("--bf16", action="store_true", help="bf16 compute with fp32 master weights")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each transformer block (config: compile.enabled); the first steps compile")
    parser.add_argument("--lr", type=_positive_float, default=None,
                        help=f"peak learning rate (default: the config's, else {DEFAULT_LR}); also fills "
                        "a config's \"auto\" learning rates")
    below_default = [name for name in optimizer_names() if optimizer_stage(name) is not None]
    parser.add_argument("--optimizer", choices=optimizer_names(), default=None,
                        help="optimizer, with settings for this job (default: the config's, else adamw); "
                        f"{' and '.join(below_default)} run at the highest ZeRO stage they support unless --stage "
                        "or the config says otherwise")
    parser.add_argument("--activation-checkpointing", choices=RECOMPUTE_POLICIES, default=None, metavar="POLICY",
                        help="recomputation policy: " + ", ".join(RECOMPUTE_POLICIES) + " (config: "
                        "activation_checkpointing.policy, every_k with activation_checkpointing.every_k; default: "
                        "the config's, else none)")
    parser.add_argument("--seed", type=int, default=None,
                        help=f"seed of initialisation and data order (default: the config's, else {DEFAULT_SEED})")
    parser.add_argument("--name", type=_run_name, default=None,
                        help="run directory name, inside --out-dir (default: from model, stage and time)")
    parser.add_argument("--out-dir", default="runs", help="where run directories go (default: runs)")
    parser.add_argument("--save-every", type=_positive_int, default=None, metavar="N",
                        help="also write a checkpoint every N optimizer steps (default: only the final one)")
    parser.add_argument("--resume", nargs="?", const="latest", default=None, metavar="TAG",
                        help="continue the run --name in --out-dir from its checkpoint TAG (default: the last one), "
                        "with the run's own settings; --nproc may differ (the global batch stays)")
    parser.add_argument("--profile", action="store_true",
                        help="record a torch.profiler trace of a few steps into NAME/profile (view with TensorBoard)")
    parser.add_argument("--compare-stages", action="store_true",
                        help="run stages 0-3 briefly and plot measured vs formula memory and communication per stage")
    parser.set_defaults(handler=main)
    return parser


def main(args: argparse.Namespace) -> int:
    from shardwise.frontends.deepspeed.config.errors import ConfigError

    started = time.perf_counter()
    with interruptible():
        try:
            raise_deferred_stop()
            options, nproc = prepare_run(args)
        except (ValueError, ConfigError, OSError) as error:
            print(f"shardwise train: error: {error}", file=sys.stderr)
            return 2
        except Interrupted as stop:
            print(f"shardwise train: {stop} before any rank started", file=sys.stderr)
            return stop.exit_code
        try:
            return _run(options, nproc, started)
        except Interrupted as stop:
            print(interrupted_message(stop, options), file=sys.stderr)
            return stop.exit_code


def interrupted_message(stop: Interrupted, options: TrainOptions) -> str:
    """The one line an interrupted run ends with: the signal, the run directory, and the
    checkpoint the ranks wrote last (at the step they stopped, unless a second signal
    or torchrun's shutdown timeout cut them short)."""
    tag = last_checkpoint(options.path)
    saved = f"last checkpoint: {tag}" if tag else "no checkpoint written"
    return f"shardwise train: {stop}; partial results are in {options.run_dir}/ ({saved})"


def _run(options: TrainOptions, nproc: int, started: float) -> int:
    from shardwise.tools.train.launch import launch_ranks, threads_per_rank

    status = launch_ranks(options.path / OPTIONS_FILE, nproc, threads_per_rank(nproc))
    if status:
        print(f"shardwise train: a rank failed; partial results are in {options.run_dir}", file=sys.stderr)
        return status
    report_run(options.path, options.compare_stages)
    elapsed = time.perf_counter() - started
    print(f"done in {elapsed:.0f} s: {options.run_dir}/ holds {', '.join(_listing(options.path))}")
    return 0


def prepare_run(args: argparse.Namespace) -> tuple[TrainOptions, int]:
    """Options for the ranks, written to the new run directory, and the number of ranks.

    Everything that can be wrong with the flags or the config is found here, before any
    process starts: the config is resolved exactly as the ranks will resolve it.
    """
    from shardwise.frontends.deepspeed.config import fill_auto, load_config
    from shardwise.tools.data import prepare_corpus
    from shardwise.tools.launcher.cli import resolve_nproc
    from shardwise.models import GPTConfig

    if args.resume is not None:
        return resumed_run(args)
    if args.compare_stages and args.stage is not None:
        raise ValueError("--compare-stages runs every stage; drop --stage")
    if args.compare_stages and args.profile:
        raise ValueError("--profile traces a training run; it does not apply to --compare-stages")
    if args.compare_stages and args.save_every:
        raise ValueError("--save-every checkpoints a training run; it does not apply to --compare-stages")
    steps = args.steps or (DEFAULT_COMPARE_STEPS if args.compare_stages else DEFAULT_STEPS)
    if args.profile:
        from shardwise.tools.profiling import steps_needed

        if steps < steps_needed(1):
            raise ValueError(
                f"--profile needs at least {steps_needed(1)} steps (one skipped, one warm-up, one recorded)"
            )
    nproc = resolve_nproc(args).nproc
    moe = _moe_options(args, nproc)
    user_config = _read_config(args.config) if args.config else {}
    seed = args.seed if args.seed is not None else user_config.get("seed", DEFAULT_SEED)
    optimizer = optimizer_block(args.optimizer, steps) if args.optimizer else None
    stage = args.stage
    if stage is None and args.optimizer and "stage" not in user_config.get("zero_optimization", {}):
        stage = optimizer_stage(args.optimizer)  # the 1-bit optimizers: 2 (optim/onebit.py: why not 3)
    config = apply_flags(merge_config(default_config(steps), user_config), stage, args.bf16, seed, lr=args.lr,
                         compile_blocks=args.compile, optimizer=optimizer, recompute=args.activation_checkpointing)
    config = fill_auto(config, auto_values(steps, args.lr))
    load_config(config, world_size=nproc, hidden_size=GPTConfig.preset(args.model_size).n_embd)

    out_dir = Path(args.out_dir)
    stage = config.get("zero_optimization", {}).get("stage", 0)
    name = args.name or _default_name(args.model_size, stage, dtype_name(config), args.compare_stages)
    run_dir = out_dir / name
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ValueError(f"{run_dir} already exists and is not empty; choose another --name or --out-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    options = TrainOptions(
        run_dir=str(run_dir),
        corpus_path=str(prepare_corpus(out_dir / CORPUS_CACHE_DIR)),
        config=config,
        model_size=args.model_size,
        steps=steps,
        seq_len=args.seq_len,
        seed=seed,
        profile=args.profile,
        compare_stages=args.compare_stages,
        save_every=args.save_every,
        **moe,
    )
    options.save(run_dir / OPTIONS_FILE)
    return options, nproc


def _moe_options(args: argparse.Namespace, nproc: int) -> dict[str, int]:
    """The MoE flags as TrainOptions fields, checked before any process starts."""
    moe = {"moe_experts": args.moe_experts or 0, "moe_top_k": args.moe_top_k, "moe_every": args.moe_every,
           "ep_size": args.ep_size}
    if not args.moe_experts:
        given = [flag for flag, value, default in (("--moe-top-k", args.moe_top_k, 1), ("--moe-every", args.moe_every,
                 1), ("--ep-size", args.ep_size, 1)) if value != default]
        if given:
            raise ValueError(f"{', '.join(given)} shape MoE blocks: give --moe-experts too")
        return moe
    if args.moe_experts % args.ep_size or nproc % args.ep_size:
        raise ValueError(f"--ep-size {args.ep_size} must divide --moe-experts {args.moe_experts} and the "
                         f"{nproc} processes (each rank of an expert group holds experts / ep-size of each MoE block)")
    return moe


def resumed_run(args: argparse.Namespace) -> tuple[TrainOptions, int]:
    """`--resume [TAG]`: the run's own options, to continue from its checkpoint TAG on
    `--nproc` ranks. Its batches are drawn from the step number and the seed alone
    (tools/data/sampler.py), so the checkpoint's step is its whole data position, at any
    number of ranks."""
    from shardwise.frontends.deepspeed.config import load_config
    from shardwise.models import GPTConfig
    from shardwise.runtime.checkpoint.format import META, read_json
    from shardwise.tools.launcher.cli import resolve_nproc

    if args.name is None:
        raise ValueError("--resume continues a run: name it with --name (and --out-dir if not runs)")
    run_dir = Path(args.out_dir) / args.name
    if not (run_dir / OPTIONS_FILE).is_file():
        raise ValueError(f"--resume: {run_dir} holds no shardwise train run ({OPTIONS_FILE} is missing)")
    settings = {"--stage": args.stage, "--config": args.config, "--lr": args.lr, "--optimizer": args.optimizer,
                "--seed": args.seed, "--steps": args.steps, "--activation-checkpointing": args.activation_checkpointing,
                "--save-every": args.save_every, "--moe-experts": args.moe_experts, "--bf16": args.bf16 or None, "--compile": args.compile or None,
                "--profile": args.profile or None, "--compare-stages": args.compare_stages or None}
    given = [flag for flag, value in settings.items() if value is not None]
    if given:
        raise ValueError(f"--resume continues the run with its own settings ({run_dir / OPTIONS_FILE}); "
                         f"drop {', '.join(given)}")
    options = TrainOptions.load(run_dir / OPTIONS_FILE)
    tag = last_checkpoint(run_dir) if args.resume == "latest" else args.resume
    if tag is None or not (run_dir / CHECKPOINT_DIR / tag / META).is_file():
        raise ValueError(f"--resume: {run_dir / CHECKPOINT_DIR} has no checkpoint {tag or '(none written)'}")
    step = read_json(run_dir / CHECKPOINT_DIR / tag / META)["client_state"]["step"]
    if step >= options.steps:
        raise ValueError(f"--resume: checkpoint {tag} is at step {step}, the run's last ({options.steps}): "
                         "nothing left to train")
    nproc = resolve_nproc(args).nproc
    load_config(options.config, world_size=nproc, hidden_size=GPTConfig.preset(options.model_size).n_embd)
    options.resume_tag = tag
    options.save(run_dir / OPTIONS_FILE)
    return options, nproc


def report_run(run_dir: Path, compare_stages: bool) -> None:
    """Tables on the terminal and PNGs in the run directory, from the ranks' files."""
    from rich.console import Console

    from shardwise.tools.train.metrics import read_metrics
    from shardwise.tools.train.plots import plot_loss, plot_memory, plot_stage_comparison
    from shardwise.tools.train.report import load_json, print_comparison_report, print_training_report

    console = Console()
    if not console.is_terminal:  # a log file has no width; do not wrap tables at 80 columns
        console = Console(width=REPORT_WIDTH)
    if compare_stages:
        print_comparison_report(run_dir, console)
        plot_stage_comparison(load_json(run_dir / COMPARISON_FILE), run_dir / COMPARISON_PLOT)
        return
    print_training_report(run_dir, console)
    summary = load_json(run_dir / SUMMARY_FILE)
    records = read_metrics(run_dir)
    plot_loss(records, summary["final"]["val_loss"], run_dir / LOSS_PLOT)
    plot_memory(records, summary, run_dir / MEMORY_PLOT)


def _read_config(path: str) -> dict:
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ValueError(f"cannot read --config {path}: {error.strerror}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--config {path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config {path} must hold a JSON object, got {type(config).__name__}")
    return config


def _default_name(model_size: str, stage: int, dtype: str, compare_stages: bool) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if compare_stages:
        return f"compare-stages-{model_size}-{dtype}-{stamp}"
    return f"{model_size}-zero{stage}-{dtype}-{stamp}"


def _listing(run_dir: Path) -> list[str]:
    return sorted(p.name + ("/" if p.is_dir() else "") for p in run_dir.iterdir())


def _run_name(text: str) -> str:
    """A run directory name stays inside --out-dir: one plain path component, and not the
    corpus cache that runs share there."""
    separators = {os.sep, os.altsep} - {None}
    if text in ("", ".", "..") or any(separator in text for separator in separators):
        raise argparse.ArgumentTypeError(
            f"{text!r} would not be a directory inside --out-dir: give a plain name, without "
            f"path separators, not '.' or '..'"
        )
    if text == CORPUS_CACHE_DIR:
        raise argparse.ArgumentTypeError(f"{text!r} is the corpus cache inside --out-dir; choose another name")
    return text


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
