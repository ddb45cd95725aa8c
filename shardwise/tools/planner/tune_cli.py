"""`shardwise tune`: DeepSpeed's autotuner on shardwise's memory estimator and time model.

    shardwise tune --config ds_config.json --nproc 2 --seq-len 1024 --preset gpt2 \
        train.py --deepspeed_config ds_config.json

is `deepspeed --autotuning tune train.py --deepspeed_config ds_config.json` (`--then-run`:
`--autotuning run`).

The config's `autotuning` block holds the settings, read as DeepSpeed 0.19.8 reads them.
The candidates (tune.py) that fit are measured by running the user's unmodified script
once each through `shardwise run`, with the trial's config in place of the given one on
its command line and `autotuning.enabled` set, so the engine itself times steps
start_profile_step..end_profile_step, writes metrics.json and exits (runtime/engine/trial.py).
Laid out as DeepSpeed's autotuner lays out its results:

    <exps_dir>/<exp>.json                      the experiment: name, ds_config, num_gpus, num_nodes
    <results_dir>/<exp>/ds_config.json         the config the trial ran
    <results_dir>/<exp>/cmd.txt, exp.json, metrics.json, stdout.log, stderr.log
    <results_dir>/ds_config_optimal.json       the best measured config (the autotuning block removed)
    <results_dir>/cmd_optimal.txt              the command that trains with it
    <results_dir>/summary.txt                  every candidate: pruned (why), predicted, measured
    <results_dir>/report.json                  the same, for programs

`--then-run` (DeepSpeed's `--autotuning run`) trains with the best config afterwards.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.formulas.memory import RECOMPUTE_MODES
from shardwise.formulas.model_shape import ModelShape
from shardwise.formulas.step_time import Speeds
from shardwise.frontends.deepspeed.config import load_config
from shardwise.frontends.deepspeed.config.schema import AutotuningConfig, ShardwiseConfig
from shardwise.models.shapes import PRESETS, preset_shape, shape_from_hf_config
from shardwise.tools.planner.devices import DATASHEETS, datasheet, load_profile
from shardwise.tools.planner.optimizers import optimizer_names
from shardwise.tools.planner.recommend import DEFAULT_HEADROOM, Hardware
from shardwise.tools.planner.tune import (
    Candidate,
    Pruned,
    Ranked,
    SearchSpace,
    Workload,
    better_key,
    candidates,
    metric_value,
    model_flops_per_device,
    prune,
    rank,
)

CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed", "--config")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "tune", help="autotune a training script's DeepSpeed config (the config's autotuning block)",
        description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--config", required=True, metavar="PATH",
                        help="the DeepSpeed config the script is given; it must appear among the script's arguments")
    parser.add_argument("--nproc", type=int, default=2, help="processes per trial (default 2)")
    parser.add_argument("--tuner-type", choices=("gridsearch", "random", "model_based"),
                        help="overrides autotuning.tuner_type")
    parser.add_argument("--then-run", action="store_true",
                        help="train with the best config afterwards (deepspeed --autotuning run)")
    model = parser.add_argument_group("the model, for the estimator and the time model")
    model.add_argument("--preset", choices=list(PRESETS))
    model.add_argument("--hf-config", metavar="PATH")
    model.add_argument("--heads", type=int, help="attention heads (with autotuning.model_info)")
    model.add_argument("--vocab-size", type=int, help="vocabulary (with autotuning.model_info)")
    model.add_argument("--seq-len", type=int, required=True, help="the script's sequence length")
    space = parser.add_argument_group("the search space (beside the autotuning block's micro-batch bounds)")
    space.add_argument("--stages", default="0,1,2,3", help="ZeRO stages (default 0,1,2,3)")
    space.add_argument("--recompute", default="none", help=f"of {', '.join(RECOMPUTE_MODES)} (default none)")
    space.add_argument("--no-offload", action="store_true", help="do not try CPU offload")
    space.add_argument("--tp-sizes", default=None, help="tensor_parallel sizes the script allows (default mp_size)")
    space.add_argument("--pp-sizes", default="1", help="pipeline_parallel sizes the script allows (default 1)")
    space.add_argument("--bucket-sizes", default="5e7,5e8,1e9",
                       help="reduce/allgather bucket sizes when autotuning.fast is false (DeepSpeed's)")
    space.add_argument("--prefetch-sizes", default="5e7",
                       help="stage3_prefetch_bucket_size values when autotuning.fast is false")
    hardware = parser.add_argument_group("the devices")
    hardware.add_argument("--device-memory", type=float, metavar="GB",
                          help="per rank (default: the GPU's, or on CPU the host's divided among the ranks)")
    hardware.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM)
    speed = hardware.add_mutually_exclusive_group()
    speed.add_argument("--device", choices=list(DATASHEETS), help="price on this GPU's datasheet")
    speed.add_argument("--speed-profile", metavar="PATH", help="price on a `shardwise estimate --measure` profile")
    parser.add_argument("--trial-timeout", type=float, default=600.0, metavar="S", help="seconds per trial")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    parser.set_defaults(handler=main)
    return parser


@dataclass(frozen=True)
class Trial:
    """One measured candidate: its metric, or why it failed."""

    ranked: Ranked
    measured: float | None
    error: str | None = None


def main(args: argparse.Namespace) -> int:
    previous = signal.signal(signal.SIGTERM, _interrupt)  # so that a stopped tune stops its running trial too
    try:
        return _tune(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _tune(args: argparse.Namespace) -> int:
    try:
        raw = json.loads(Path(args.config).read_text())
        config = load_config(raw, world_size=args.nproc)
        if not any(arg == args.config for arg in args.script_args):
            raise ValueError(f"the script's arguments do not include {args.config}: pass the config to the script "
                             "as it reads it (e.g. --deepspeed_config ds_config.json), so each trial can swap it")
        block = config.autotuning
        results, exps = _clean_folders(block)
        workload = Workload(_shape(args, block), _hardware(args), _speeds(args, config), args.seq_len,
                            _dtype(config), _optimizer(config))
        space = _space(args, config, block)
    except (ValueError, FileNotFoundError, json.JSONDecodeError) as error:
        print(f"shardwise tune: error: {error}", file=sys.stderr)
        return 2
    tuner = args.tuner_type or block.tuner_type
    kept, pruned = prune(candidates(space), workload)
    ranked = rank(kept, workload, block.metric)
    print(f"shardwise tune: {len(kept) + len(pruned)} candidates, {len(pruned)} pruned, {len(kept)} fit; "
          f"{tuner} on {block.metric}", flush=True)
    trials = _run_trials(_order(ranked, tuner), raw, args, block, workload, tuner, results, exps)
    best = _best(trials, block.metric)
    _write_report(results, ranked, pruned, trials, best, block.metric, tuner)
    if best is None:
        print(f"shardwise tune: no trial succeeded; see {results}/*/stderr.log", file=sys.stderr)
        return 1
    optimal = _trial_config(raw, best.ranked.candidate, block, results / best.ranked.candidate.name)
    optimal.pop("autotuning")
    (results / "ds_config_optimal.json").write_text(json.dumps(optimal, indent=2) + "\n")
    command = _command(args, results / "ds_config_optimal.json", best.ranked.candidate, block)
    (results / "cmd_optimal.txt").write_text(shlex.join(command) + "\n")
    print(f"shardwise tune: best {best.ranked.candidate.name} ({block.metric} {best.measured:.4g}); wrote "
          f"{results / 'ds_config_optimal.json'} and {results / 'summary.txt'}", flush=True)
    if args.then_run:
        return subprocess.run(command, check=False).returncode
    return 0


def _clean_folders(block: AutotuningConfig) -> tuple[Path, Path]:
    """results_dir and exps_dir, emptied first with `overwrite` (DeepSpeed's default)."""
    results, exps = Path(block.results_dir), Path(block.exps_dir)
    for folder in (results, exps):
        if block.overwrite and folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
    return results, exps


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM as Ctrl-C: `subprocess.run` kills the trial's launcher on the way out, and the
    launcher's lifeline takes its workers with it."""
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def _shape(args: argparse.Namespace, block: AutotuningConfig) -> ModelShape:
    if args.preset:
        return preset_shape(args.preset)
    if args.hf_config:
        return shape_from_hf_config(args.hf_config)
    info = block.model_info
    if info is None or None in (info.num_params, info.hidden_size, info.num_layers) or args.heads is None:
        raise ValueError("the time model needs the model's layout: give --preset or --hf-config, or "
                         "autotuning.model_info {num_params, hidden_size, num_layers} with --heads")
    return ModelShape.from_params(info.num_params, info.hidden_size, info.num_layers, args.heads, args.vocab_size)


def _hardware(args: argparse.Namespace) -> Hardware:
    import psutil
    import torch

    host_gb = psutil.virtual_memory().total / 1e9
    if args.device_memory is not None:
        device_gb = args.device_memory
    elif torch.cuda.is_available():
        device_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    else:  # CPU ranks share the host's memory
        device_gb = host_gb / args.nproc
    return Hardware(args.nproc, args.nproc, device_gb, host_gb, 0.0, args.headroom)


def _speeds(args: argparse.Namespace, config: ShardwiseConfig) -> Speeds:
    if args.speed_profile:
        return load_profile(args.speed_profile)
    if args.device:
        return datasheet(args.device)
    from shardwise.tools.planner.measure import measure

    return measure(Path(config.autotuning.results_dir) / "speed_profile.json", ranks=args.nproc)


def _dtype(config: ShardwiseConfig) -> str:
    return "bf16" if config.bf16.enabled else "fp16" if config.fp16.enabled else "fp32"


def _optimizer(config: ShardwiseConfig) -> str:
    name = config.optimizer.type.lower() if config.optimizer is not None else "adam"
    return name if name in optimizer_names() else "adam"


def _sizes(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(float(value)) for value in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give comma-separated numbers such as 1,2") from None
    if not values or min(values) <= 0:
        raise ValueError(f"{flag} {text!r}: sizes must be positive")
    return values


def _space(args: argparse.Namespace, config: ShardwiseConfig, block: AutotuningConfig) -> SearchSpace:
    """The micro-batches as DeepSpeed's autotuner picks them (`num_tuning_micro_batch_sizes`
    between the min and max per GPU, no global batch above max_train_batch_size), the
    user's accumulation, and the other settings' values; with `fast` (DeepSpeed's default)
    the bucket and prefetch sizes stay the config's."""
    recompute = tuple(args.recompute.split(","))
    if not set(recompute) <= set(RECOMPUTE_MODES):
        raise ValueError(f"--recompute {args.recompute!r}: choose among {', '.join(RECOMPUTE_MODES)}")
    stages = tuple(int(stage) for stage in args.stages.split(",") if stage.strip().isdigit())
    if not stages or not set(stages) <= {0, 1, 2, 3} or len(stages) != len(args.stages.split(",")):
        raise ValueError(f"--stages {args.stages!r}: give comma-separated ZeRO stages among 0, 1, 2 and 3")
    zero = config.zero_optimization
    fast = block.fast
    return SearchSpace(
        stages=stages,
        micro_batches=_micro_batches(block, config.gradient_accumulation_steps, args.nproc),
        offload=not args.no_offload,
        recompute=recompute,  # type: ignore[arg-type]
        tensor_sizes=_sizes(args.tp_sizes, "--tp-sizes") if args.tp_sizes else (block.mp_size,),
        pipeline_sizes=_sizes(args.pp_sizes, "--pp-sizes"),
        reduce_buckets=(zero.reduce_bucket_size,) if fast else _sizes(args.bucket_sizes, "--bucket-sizes"),
        allgather_buckets=(zero.allgather_bucket_size,) if fast else _sizes(args.bucket_sizes, "--bucket-sizes"),
        prefetch_buckets=(zero.stage3_prefetch_bucket_size,) if fast else _sizes(args.prefetch_sizes,
                                                                                 "--prefetch-sizes"),
        accumulation=config.gradient_accumulation_steps,
    )


def _micro_batches(block: AutotuningConfig, accumulation: int, nproc: int) -> tuple[int, ...]:
    """Powers of two from the minimum up to the maximum per GPU (and the global batch
    bound), the largest `num_tuning_micro_batch_sizes` of them, as DeepSpeed's tuner keeps
    the largest that fit."""
    low, high = block.min_train_micro_batch_size_per_gpu, block.max_train_micro_batch_size_per_gpu
    if block.max_train_batch_size is not None:
        high = min(high, block.max_train_batch_size // (accumulation * nproc))
    if high < low:
        raise ValueError(f"autotuning.max_train_batch_size {block.max_train_batch_size} leaves no micro-batch of at "
                         f"least {low} per GPU at {accumulation} accumulation steps and {nproc} ranks")
    sizes, size = [], low
    while size <= high:
        sizes.append(size)
        size *= 2
    return tuple(sizes[-block.num_tuning_micro_batch_sizes:])


def _order(ranked: list[Ranked], tuner: str) -> list[Ranked]:
    if tuner == "random":
        shuffled = list(ranked)
        random.Random(0).shuffle(shuffled)
        return shuffled
    if tuner == "gridsearch":  # the grid's own order, DeepSpeed's: stage by stage
        return sorted(ranked, key=lambda entry: entry.candidate.plan.stage)
    return ranked


def _run_trials(order: list[Ranked], raw: dict, args: argparse.Namespace, block: AutotuningConfig,
                workload: Workload, tuner: str, results: Path, exps: Path) -> list[Trial]:
    """Measure in `order`: at most tuner_num_trials, stopping once tuner_early_stopping
    trials in a row have not beaten the best so far."""
    trials: list[Trial] = []
    best: float | None = None
    since_best = 0
    for entry in order[:block.tuner_num_trials]:
        trial = _run_one(entry, raw, args, block, workload, results, exps)
        trials.append(trial)
        shown = "failed" if trial.measured is None else f"{trial.measured:.4g}"
        print(f"  {entry.candidate.name}: predicted {entry.predicted_metric:.4g}, measured {shown}", flush=True)
        if trial.measured is not None and (best is None or better_key(block.metric, trial.measured)
                                           < better_key(block.metric, best)):
            best, since_best = trial.measured, 0
        else:
            since_best += 1
        if since_best >= block.tuner_early_stopping:  # every tuner type, as DeepSpeed's BaseTuner.tune
            break
    return trials


def _trial_config(raw: dict, candidate: Candidate, block: AutotuningConfig, folder: Path) -> dict:
    config = _merged(copy.deepcopy(raw), candidate.config_overrides())
    for derived in ("train_batch_size",):  # follows from the micro-batch, accumulation and ranks
        config.pop(derived, None)
    autotuning = dict(raw.get("autotuning", {}))
    autotuning.update(enabled=True, metric_path=str((folder / "metrics.json").resolve()),
                      start_profile_step=block.start_profile_step, end_profile_step=block.end_profile_step)
    config["autotuning"] = autotuning
    return config


def _merged(base: dict, overrides: dict) -> dict:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merged(base[key], value)
        else:
            base[key] = value
    return base


def _command(args: argparse.Namespace, config_path: Path, candidate: Candidate,
             block: AutotuningConfig) -> list[str]:
    """`shardwise run` of the script with `config_path` in place of the given config, and
    `arg_mappings` (DeepSpeed config key -> script flag) set to the candidate's values."""
    script_args = [str(config_path) if arg == args.config else arg for arg in args.script_args]
    values = {"train_micro_batch_size_per_gpu": candidate.plan.micro_batch,
              "gradient_accumulation_steps": candidate.plan.accumulation}
    for key, flag in (block.arg_mappings or {}).items():
        if key not in values:
            continue
        if flag in script_args:
            script_args[script_args.index(flag) + 1] = str(values[key])
        else:
            script_args += [flag, str(values[key])]
    return [sys.executable, "-m", "shardwise.tools.cli.main", "run", "--nproc", str(args.nproc), args.script,
            *script_args]


def _run_one(entry: Ranked, raw: dict, args: argparse.Namespace, block: AutotuningConfig, workload: Workload,
             results: Path, exps: Path) -> Trial:
    candidate = entry.candidate
    folder = results / candidate.name
    folder.mkdir(parents=True, exist_ok=True)
    config = _trial_config(raw, candidate, block, folder)
    (folder / "ds_config.json").write_text(json.dumps(config, indent=2) + "\n")
    experiment = {"name": candidate.name, "ds_config": config, "num_gpus": args.nproc, "num_nodes": 1,
                  "hostfile": None, "result_dir": str(folder)}
    (exps / f"{candidate.name}.json").write_text(json.dumps(experiment) + "\n")
    (folder / "exp.json").write_text(json.dumps(experiment) + "\n")
    command = _command(args, folder / "ds_config.json", candidate, block)
    (folder / "cmd.txt").write_text(shlex.join(command) + "\n")
    with open(folder / "stdout.log", "w") as out, open(folder / "stderr.log", "w") as err:
        try:
            done = subprocess.run(command, stdout=out, stderr=err, timeout=args.trial_timeout, check=False,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except subprocess.TimeoutExpired:
            return Trial(entry, None, f"timed out after {args.trial_timeout:g} s")
    metrics_path = folder / "metrics.json"
    if done.returncode != 0 or not metrics_path.exists():
        tail = (folder / "stderr.log").read_text().strip().splitlines()[-1:] or ["no output"]
        return Trial(entry, None, f"exit status {done.returncode}: {tail[0]}")
    metrics = json.loads(metrics_path.read_text())
    samples = metrics["throughput"] * metrics["latency"]
    flops = model_flops_per_device(workload, samples_per_step=samples)
    measured = metric_value(block.metric, latency=metrics["latency"], samples_per_step=samples,
                            flops_per_device=flops)
    metrics["flops_per_device"] = flops / metrics["latency"]
    metrics_path.write_text(json.dumps(metrics) + "\n")
    return Trial(entry, measured)


def _best(trials: list[Trial], metric: str) -> Trial | None:
    measured = [trial for trial in trials if trial.measured is not None]
    return min(measured, key=lambda trial: better_key(metric, trial.measured)) if measured else None


def _write_report(results: Path, ranked: list[Ranked], pruned: list[Pruned], trials: list[Trial],
                  best: Trial | None, metric: str, tuner: str) -> None:
    """summary.txt (a table, best measured first) and report.json: every candidate, predicted
    vs measured, and the pruned ones with why."""
    by_name = {trial.ranked.candidate.name: trial for trial in trials}
    rows = []
    for position, entry in enumerate(ranked, 1):
        trial = by_name.get(entry.candidate.name)
        rows.append({"name": entry.candidate.name, "predicted_rank": position,
                     "predicted": entry.predicted_metric, "predicted_step_s": entry.prediction.step_s,
                     "measured": trial.measured if trial else None,
                     "status": "not run" if trial is None else trial.error or "measured"})
    rows += [{"name": item.candidate.name, "predicted_rank": None, "predicted": None, "predicted_step_s": None,
              "measured": None, "status": f"pruned: {item.reason}"} for item in pruned]
    report = {"metric": metric, "tuner_type": tuner, "trials": len(trials), "candidates": len(rows),
              "best": best.ranked.candidate.name if best else None, "rows": rows}
    (results / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"metric: {metric} ({'lower' if metric == 'latency' else 'higher'} is better); tuner: {tuner}; "
             f"{len(trials)} trials of {len(ranked)} fitting candidates ({len(pruned)} pruned)",
             f"best: {report['best']}", "",
             f"{'experiment':<60} {'pred. rank':>10} {'predicted':>11} {'measured':>11}  status"]
    measured_first = sorted(rows, key=lambda row: (row["measured"] is None, row["predicted"] is None,
                                                   better_key(metric, row["measured"] or row["predicted"] or 0)))
    for row in measured_first:
        lines.append(f"{row['name']:<60} {row['predicted_rank'] or '-':>10} "
                     f"{_number(row['predicted']):>11} {_number(row['measured']):>11}  {row['status']}")
    (results / "summary.txt").write_text("\n".join(lines) + "\n")


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"
