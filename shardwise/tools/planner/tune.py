"""What `shardwise tune` searches: the candidates, the ones the memory estimator rules out,
and the order the time model puts the rest in.

A candidate is one plan (shardwise/tools/planner/timing.py's `Plan`: ZeRO stage, offload,
recomputation, tensor and pipeline sizes, micro-batch, bucket sizes) plus the stage-3
prefetch size, which the time model does not price (the engine prefetches behind compute;
it only changes how much is gathered ahead). Each is

    pruned    when the estimator says it does not fit the device (`estimate`'s options:
              the (stage, offload) pair is not offered with these sizes, or its memory
              with this recomputation exceeds the device), or when it would run exactly
              like another candidate (every bucket size at or above the rank's gradient
              count is one bucket: the same messages);
    ranked    by the time model's prediction of the autotuning metric: throughput
              (samples/s), latency (s per step) or flops (model FLOP/s per device).

DeepSpeed's tuner types decide the order of measurement (tune_cli.py): `gridsearch` stage
by stage, `random` shuffled, `model_based` (shardwise's time model in place of DeepSpeed's
XGBoost cost model) best predicted first; every type stops after `tuner_num_trials`, or
once `tuner_early_stopping` trials in a row have not beaten the best measured.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from math import ceil
from typing import Iterable

from shardwise.formulas.memory import NO_OFFLOAD, Offload, RecomputeMode
from shardwise.formulas.model_shape import ModelShape
from shardwise.formulas.parallel_activation import ModelParallel
from shardwise.formulas.stages import partitions_parameters
from shardwise.formulas.step_time import Speeds, training_flops_per_token
from shardwise.tools.planner.recommend import Hardware, check_parallel, estimate
from shardwise.tools.planner.timing import Plan, Prediction, predict

OFFLOADS_BY_STAGE: dict[int, tuple[Offload, ...]] = {
    0: (NO_OFFLOAD,),
    1: (NO_OFFLOAD, Offload("cpu")),
    2: (NO_OFFLOAD, Offload("cpu")),
    3: (NO_OFFLOAD, Offload("cpu"), Offload("cpu", "cpu")),
}
METRICS = ("throughput", "latency", "flops")


@dataclass(frozen=True)
class SearchSpace:
    """The values each setting takes; every combination is a candidate."""

    stages: tuple[int, ...] = (0, 1, 2, 3)
    micro_batches: tuple[int, ...] = (1,)
    offload: bool = True  # try CPU offload of the optimizer (stages 1-3) and of the parameters (stage 3)
    recompute: tuple[RecomputeMode, ...] = ("none",)
    tensor_sizes: tuple[int, ...] = (1,)
    pipeline_sizes: tuple[int, ...] = (1,)
    reduce_buckets: tuple[int, ...] = (500_000_000,)
    allgather_buckets: tuple[int, ...] = (500_000_000,)
    prefetch_buckets: tuple[int, ...] = (50_000_000,)
    accumulation: int = 1


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    prefetch_bucket: int

    @property
    def name(self) -> str:
        """DeepSpeed's experiment name (z<stage>_gas<g>_tmbspg<micro-batch>), then what else differs."""
        plan = self.plan
        parts = [f"z{plan.stage}_gas{plan.accumulation}_tmbspg{plan.micro_batch}"]
        if plan.offload.optimizer != "none":
            parts.append(f"offopt-{plan.offload.optimizer}")
        if plan.offload.params != "none":
            parts.append(f"offparam-{plan.offload.params}")
        if plan.recompute != "none":
            parts.append(f"ac-{plan.recompute}")
        if plan.parallel.tensor > 1:
            parts.append(f"tp{plan.parallel.tensor}")
        if plan.parallel.pipeline > 1:
            parts.append(f"pp{plan.parallel.pipeline}")
        parts.append(f"rbs{plan.reduce_bucket:.0e}".replace("+0", "").replace("+", ""))
        if plan.stage in (1, 2):
            parts.append(f"agbs{plan.allgather_bucket:.0e}".replace("+0", "").replace("+", ""))
        if partitions_parameters(plan.stage):
            parts.append(f"pfbs{self.prefetch_bucket:.0e}".replace("+0", "").replace("+", ""))
        return "_".join(parts)

    def config_overrides(self) -> dict:
        """The DeepSpeed config keys this candidate sets (merged over the user's config)."""
        plan = self.plan
        zero: dict = {"stage": plan.stage, "reduce_bucket_size": plan.reduce_bucket}
        if plan.stage in (1, 2):
            zero["allgather_bucket_size"] = plan.allgather_bucket
        if partitions_parameters(plan.stage):
            zero["stage3_prefetch_bucket_size"] = self.prefetch_bucket
        zero["offload_optimizer"] = {"device": plan.offload.optimizer}
        if partitions_parameters(plan.stage):
            zero["offload_param"] = {"device": plan.offload.params}
        return {
            "train_micro_batch_size_per_gpu": plan.micro_batch,
            "gradient_accumulation_steps": plan.accumulation,
            "zero_optimization": zero,
            "activation_checkpointing": {"policy": plan.recompute},
            "tensor_parallel": {"size": plan.parallel.tensor},
            "pipeline_parallel": {"size": plan.parallel.pipeline},
        }


@dataclass(frozen=True)
class Pruned:
    candidate: Candidate
    reason: str


@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    prediction: Prediction
    predicted_metric: float


@dataclass(frozen=True)
class Workload:
    """What the plans are priced for: the model, the job's devices and the training settings."""

    shape: ModelShape
    hardware: Hardware
    speeds: Speeds
    seq_len: int
    dtype: str = "fp32"
    optimizer: str = "adam"


def candidates(space: SearchSpace) -> list[Candidate]:
    """Every combination of the space's values (offload only where the stage has it)."""
    found = []
    for stage, micro_batch, recompute, tensor, pipeline in itertools.product(
            space.stages, space.micro_batches, space.recompute, space.tensor_sizes, space.pipeline_sizes):
        offloads = OFFLOADS_BY_STAGE[stage] if space.offload else (NO_OFFLOAD,)
        allgathers = space.allgather_buckets if stage in (1, 2) else space.allgather_buckets[:1]
        prefetches = space.prefetch_buckets if partitions_parameters(stage) else space.prefetch_buckets[:1]
        for offload, reduce, allgather, prefetch in itertools.product(
                offloads, space.reduce_buckets, allgathers, prefetches):
            plan = Plan(stage, offload, recompute, ModelParallel(tensor=tensor, pipeline=pipeline), micro_batch,
                        space.accumulation, reduce_bucket=reduce, allgather_bucket=allgather)
            found.append(Candidate(plan, prefetch))
    return found


def prune(found: Iterable[Candidate], workload: Workload) -> tuple[list[Candidate], list[Pruned]]:
    """The candidates that fit and differ, and the others with why they are not run."""
    kept: list[Candidate] = []
    pruned: list[Pruned] = []
    seen: dict[tuple, Candidate] = {}
    for candidate in found:
        reason = _misfit(candidate, workload)
        if reason is None:
            same = seen.setdefault(_effective(candidate, workload), candidate)
            if same is not candidate:
                reason = f"runs exactly as {same.name} (bucket sizes at or above the rank's element count are one bucket)"
        if reason is None:
            kept.append(candidate)
        else:
            pruned.append(Pruned(candidate, reason))
    return kept, pruned


def _misfit(candidate: Candidate, workload: Workload) -> str | None:
    """Why the estimator says the candidate cannot run, or None when it fits."""
    plan = candidate.plan
    try:
        check_parallel(workload.shape, workload.hardware, plan.parallel, workload.seq_len)
        result = estimate(workload.shape, workload.hardware, plan.micro_batch, workload.seq_len, workload.dtype,
                          workload.optimizer, plan.parallel)
    except ValueError as error:
        return f"not runnable: {error}"
    offered = [option for option in result.options if (option.stage, option.offload) == (plan.stage, plan.offload)]
    if not offered:
        return f"the engine does not run stage {plan.stage} with {plan.offload.label} offload and these sizes"
    option = offered[0]
    if plan.recompute in option.fitting_modes:
        return None
    device = option.shortfall or "gpu"
    needed = option.gpu_total(result.activation(plan.recompute))
    return (f"does not fit: {needed / 1e9:.3g} GB per device with {plan.recompute} recomputation, "
            f"{workload.hardware.usable_bytes('gpu') / 1e9:.3g} GB usable" if device == "gpu"
            else f"does not fit: {device} memory per node is exceeded")


def _effective(candidate: Candidate, workload: Workload) -> tuple:
    """The candidate with every bucket size the engine would treat alike set alike."""
    plan = candidate.plan
    local = ceil(workload.shape.params_per_tensor_rank(plan.parallel.tensor) / plan.parallel.pipeline)
    return (replace(plan, reduce_bucket=min(plan.reduce_bucket, local),
                    allgather_bucket=min(plan.allgather_bucket, local) if plan.stage in (1, 2) else 0),
            min(candidate.prefetch_bucket, local) if partitions_parameters(plan.stage) else 0)


def rank(kept: Iterable[Candidate], workload: Workload, metric: str) -> list[Ranked]:
    """The candidates best first by the time model's prediction of `metric`."""
    if metric not in METRICS:
        raise ValueError(f"unknown autotuning metric {metric!r}: choose one of {', '.join(METRICS)}")
    state_bytes = estimate(workload.shape, workload.hardware, 1, workload.seq_len, workload.dtype,
                           workload.optimizer).optimizer_state_bytes
    ranked = []
    for candidate in kept:
        prediction = predict(workload.shape, candidate.plan, workload.speeds, num_gpus=workload.hardware.num_gpus,
                             gpus_per_node=workload.hardware.gpus_per_node, seq_len=workload.seq_len,
                             dtype=workload.dtype, optimizer_state_bytes=state_bytes)
        samples = prediction.tokens_per_step / workload.seq_len
        ranked.append(Ranked(candidate, prediction, metric_value(
            metric, latency=prediction.step_s, samples_per_step=samples, flops_per_device=model_flops_per_device(
                workload, samples_per_step=samples))))
    return sorted(ranked, key=lambda entry: better_key(metric, entry.predicted_metric))


def model_flops_per_device(workload: Workload, *, samples_per_step: float) -> float:
    """The model's training FLOPs of one step per device (recomputation not counted, as
    DeepSpeed's flops metric counts 3× the forward)."""
    shape = workload.shape
    per_token = training_flops_per_token(shape.num_params, layers=shape.num_layers or 1,
                                         hidden=shape.hidden_size or 1, seq_len=workload.seq_len,
                                         vocab=shape.vocab_size or 0)
    return per_token * samples_per_step * workload.seq_len / workload.hardware.num_gpus


def metric_value(metric: str, *, latency: float, samples_per_step: float, flops_per_device: float) -> float:
    """The autotuning metric from seconds per step: samples/s, s per step, or FLOP/s per device."""
    if metric == "latency":
        return latency
    if metric == "throughput":
        return samples_per_step / latency
    return flops_per_device / latency


def better_key(metric: str, value: float) -> float:
    """A sort key that puts the better value first (lower latency, higher throughput or FLOP/s)."""
    return value if metric == "latency" else -value
