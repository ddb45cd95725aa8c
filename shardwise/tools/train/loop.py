"""One rank of the main job: train, checkpoint, evaluate, sample, and (rank 0) record it all.

Every rank runs the same code; rank 0 alone writes metrics, draws progress and writes
the summary, while checkpoints and the evaluation are collectives all ranks join. A
checkpoint is written every `save_every` steps when asked, at the end, and at the step
where the ranks agree to stop early (`stopping`).
"""

from __future__ import annotations

import json
import signal
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from typing import Any

import torch
from rich.console import Console

import shardwise
from shardwise.tools.data import BlockSampler
from shardwise.runtime.engine import Engine
from shardwise.tools.profiling import (
    PeakFlops,
    StepTimer,
    StepTimes,
    memory_kind,
    model_flops_utilization,
    process_memory,
    profile_steps,
)
from shardwise.tools.train.activation_report import activation_summary
from shardwise.tools.train.evaluate import full_weights, generate_sample, validation_loss
from shardwise.tools.train.expected import RunShape, comm_expressions, expected_comm, expected_memory, memory_expressions
from shardwise.tools.train.metrics import MetricsLog, step_record
from shardwise.tools.train.options import TrainOptions
from shardwise.tools.train.progress import TrainingProgress
from shardwise.tools.train.run_files import CHECKPOINT_DIR, PROFILE_DIR, SAMPLE_FILE, SUMMARY_FILE
from shardwise.tools.train.setup import DTYPE_NAMES, ModelFacts, build_model, run_shape, samplers, shared_peak_flops
from shardwise.tools.train.stopping import StopRequest


@dataclass(frozen=True)
class StepsRun:
    """How the training steps went: the last step taken, its mean loss and bytes sent, and
    the signal that stopped them early (0 when they all ran)."""

    step: int
    loss: float
    comm: dict[str, int]
    stopped_by: int = 0


def train_step(
    engine: Engine, sampler: BlockSampler, step: int, timer: StepTimer
) -> tuple[float, StepTimes | None, dict[str, int]]:
    """One optimizer step over this rank's micro-batches: (mean local loss, times (None
    when `timer` is disabled), bytes sent)."""
    engine.reset_comm_volume()
    timer.start_step()
    with timer.phase("data"):
        batches = [
            (x.to(engine.device), y.to(engine.device))
            for x, y in sampler.micro_batches(step, engine.rank, engine.world_size, engine.gradient_accumulation_steps)
        ]
    loss_sum = torch.zeros((), device=engine.device)
    for x, y in batches:
        with timer.phase("forward"):
            loss = engine(x, y)
        with timer.phase("backward"):
            engine.backward(loss)
        with timer.phase("optimizer"):
            engine.step()
        loss_sum += loss.detach().float()
    times = timer.end_step()
    return float(loss_sum.item()) / len(batches), times, engine.comm_volume()


def mean_over_ranks(engine: Engine, value: float) -> float:
    total = torch.tensor([value], dtype=torch.float64, device=engine.device)
    engine.comm.control_all_reduce(total, "mean training loss")
    return float(total.item()) / engine.world_size


def save_checkpoint(engine: Engine, options: TrainOptions, step: int) -> str:
    """Collective: this rank's shard of the state after `step`, tagged `step<N>`."""
    return engine.save_checkpoint(
        options.path / CHECKPOINT_DIR,
        tag=f"step{step}",
        client_state={"step": step, "seed": options.seed, "model_size": options.model_size},
    )


def resume(engine: Engine, options: TrainOptions) -> int:
    """Load the run's checkpoint `options.resume_tag` (weights, optimizer, schedule, RNG,
    counters) and return its step: the next step's batch is drawn from that step number
    alone, so the resumed run reads what the uninterrupted one would have read."""
    client_state = engine.load_checkpoint(options.path / CHECKPOINT_DIR, tag=options.resume_tag)
    saved = {key: client_state.get(key) for key in ("seed", "model_size")}
    if saved != {"seed": options.seed, "model_size": options.model_size}:
        raise ValueError(f"checkpoint {options.resume_tag} was written by a run with {saved}, not this run's seed "
                         f"{options.seed} and model size {options.model_size}")
    return client_state["step"]


def train(options: TrainOptions, stop: StopRequest) -> int:
    """Run the job on this rank; 0 when it ran to the end, else the signal that stopped it
    early (after a checkpoint of the last step)."""
    model, facts = build_model(options)
    engine = shardwise.initialize(model, options.config)
    train_sampler, val_sampler = samplers(options, engine.config.train_batch_size)
    peak = shared_peak_flops(engine)
    console = Console()
    if engine.rank == 0:
        console.print(_header(options, engine, facts, peak.source), highlight=False, soft_wrap=True)

    first_step = resume(engine, options) + 1 if options.resume_tag is not None else 1
    started = time.perf_counter()
    steps = run_steps(options, engine, facts, peak, train_sampler, console, stop, first_step=first_step)
    if steps.stopped_by:
        engine.destroy()
        return steps.stopped_by
    train_seconds = time.perf_counter() - started
    memory = engine.memory_breakdown()  # before evaluation gathers the full weights
    activations = activation_summary(engine, options.seq_len, options.steps)

    tag = save_checkpoint(engine, options, options.steps)
    with full_weights(engine):
        val_loss = validation_loss(engine, val_sampler)
        sample = generate_sample(model, options.sample_prompt, options.sample_tokens, options.seed, engine.device)
    if engine.rank == 0:
        (options.path / SAMPLE_FILE).write_text(sample, encoding="utf-8")
        shape = run_shape(engine, facts.num_params)
        summary = {
            "model": _model_summary(options, facts, engine),
            "run": _run_summary(options, engine, shape),
            "peak_flops_per_device": {"value": peak.flops_per_second, "source": peak.source},
            "memory": {
                "measured": memory,
                "formula": expected_memory(shape),
                "expressions": memory_expressions(shape),
            },
            "comm_per_step": {
                "measured": steps.comm,
                "formula": expected_comm(shape),
                "expressions": comm_expressions(shape),
            },
            "activations": activations,
            "persistent_params": shape.persistent_params,
            "padding_elements": engine.padding_elements(),
            **({"experts": asdict(shape.experts)} if shape.experts is not None else {}),
            "final": {"loss": steps.loss, "val_loss": val_loss},
            "train_seconds": train_seconds,
            "checkpoint": {"dir": CHECKPOINT_DIR, "tag": tag},
        }
        (options.path / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    engine.destroy()
    return 0


def run_steps(
    options: TrainOptions,
    engine: Engine,
    facts: ModelFacts,
    peak: PeakFlops,
    sampler: BlockSampler,
    console: Console,
    stop: StopRequest,
    *,
    first_step: int = 1,
) -> StepsRun:
    """The training steps from `first_step` (after a resumed checkpoint's), metrics,
    progress and periodic checkpoints, until the last step or the step at which the ranks
    agree to stop (checkpointed before returning)."""
    is_rank0 = engine.rank == 0
    tokens_per_step = engine.config.train_batch_size * options.seq_len
    timer = StepTimer(engine.comm_stats, engine.device, enabled=is_rank0)  # only rank 0 writes metrics
    with ExitStack() as stack:
        profile_dir = options.path / PROFILE_DIR if options.profile else None
        profiler_step = stack.enter_context(profile_steps(profile_dir, f"rank{engine.rank}"))
        if is_rank0:
            metrics = stack.enter_context(MetricsLog(options.path, continue_after=first_step - 1))
            progress = stack.enter_context(TrainingProgress(options.steps, console, engine.config.steps_per_print))
        for step in range(first_step, options.steps + 1):
            lr = engine.get_lr()[0]  # the rate this step uses; step() moves the schedule on
            local_loss, times, comm = train_step(engine, sampler, step - 1, timer)
            loss = mean_over_ranks(engine, local_loss)
            stopped_by = stop.agreed(engine)
            if is_rank0:
                global_flops_peak = peak.flops_per_second * engine.world_size
                record = step_record(
                    step=step,
                    loss=loss,
                    lr=lr,
                    grad_norm=engine.last_grad_norm,
                    tokens=tokens_per_step,
                    times=times,
                    mfu=model_flops_utilization(facts.flops_per_token, tokens_per_step / times.step, global_flops_peak),
                    memory={**engine.memory_breakdown(), **_prefixed("process_", process_memory(engine.device))},
                    comm_bytes=comm,
                )
                metrics.write(record)
                progress.update(record)
            if stopped_by:
                if is_rank0:
                    console.print(
                        f"{signal.Signals(stopped_by).name}: stopping after step {step} and writing checkpoint "
                        f"step{step}; interrupt again to stop at once, without it",
                        highlight=False,
                        soft_wrap=True,
                    )
                save_checkpoint(engine, options, step)
                return StepsRun(step, loss, comm, stopped_by)
            if options.save_every and step % options.save_every == 0 and step < options.steps:
                save_checkpoint(engine, options, step)  # the last step's is written after the loop
            profiler_step()
    return StepsRun(options.steps, loss, comm)


def _header(options: TrainOptions, engine: Engine, facts: ModelFacts, peak_source: str) -> str:
    cfg = engine.config
    return (
        f"[bold]shardwise train[/]: GPT {options.model_size} ({facts.num_params / 1e6:.2f}M params), "
        f"ZeRO-{engine.stage}, {engine.world_size} rank(s) on {engine.device.type} "
        f"({engine.context.backend}), {DTYPE_NAMES[engine.dtype]}\n"
        f"  {options.steps} steps x {cfg.train_batch_size} sequences x {options.seq_len} bytes "
        f"(micro-batch {cfg.train_micro_batch_size_per_gpu}, accumulation {cfg.gradient_accumulation_steps}); "
        f"peak {peak_source}\n"
        f"  writing {options.run_dir}"
    )


def _model_summary(options: TrainOptions, facts: ModelFacts, engine: Engine) -> dict[str, Any]:
    config = engine.module.config
    return {
        "size": options.model_size,
        "num_params": facts.num_params,
        "tied_params": facts.tied_params,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_embd": config.n_embd,
        "seq_len": options.seq_len,
        "flops_per_token": facts.flops_per_token,
    }


def _run_summary(options: TrainOptions, engine: Engine, shape: RunShape) -> dict[str, Any]:
    cfg = engine.config
    return {
        "steps": options.steps,
        "stage": engine.stage,
        "world_size": engine.world_size,
        "device": engine.device.type,
        "backend": engine.context.backend,
        "threads_per_rank": torch.get_num_threads(),
        "process_memory": memory_kind(engine.device),
        "dtype": shape.dtype,
        "comm_dtype": shape.comm_dtype,
        "optimizer_state_bytes": shape.optimizer_state_bytes,
        "bf16_masters": shape.bf16_masters,
        "global_batch": cfg.train_batch_size,
        "micro_batch": cfg.train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "seed": options.seed,
    }


def _prefixed(prefix: str, values: dict[str, int]) -> dict[str, int]:
    return {f"{prefix}{key}": value for key, value in values.items()}
