"""Step time and tokens per second of one plan: the plan's work (FLOPs, each group's
collectives with the overlap the engine gives them, the update's bytes, offload traffic)
put into shardwise/formulas/step_time.py. `shardwise estimate` prices every option it
prints with it, and `shardwise tune` ranks its candidates by it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import ceil
from typing import TYPE_CHECKING

from shardwise.formulas.communication import (
    CommShape,
    ParallelCommShape,
    comm_bytes_by_group,
    offload_transfer_bytes,
    pipeline_p2p_bytes,
    PipelineCommShape,
    tensor_parallel_comm_bytes,
    ulysses_comm_bytes,
)
from shardwise.formulas.memory import NO_OFFLOAD, Offload, element_bytes
from shardwise.formulas.model_shape import ModelShape
from shardwise.formulas.parallel_activation import NO_MODEL_PARALLEL, ModelParallel
from shardwise.formulas.stages import keeps_full_gradients, partitions_optimizer, partitions_parameters
from shardwise.formulas.step_time import (
    CommTerm,
    Speeds,
    StepTime,
    StepWork,
    buckets,
    fp32_accumulation_bytes,
    optimizer_update_bytes,
    step_seconds,
    training_flops_per_token,
)

if TYPE_CHECKING:
    from shardwise.tools.planner.results import Estimate

DEFAULT_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's reduce_bucket_size / allgather_bucket_size default
# Stage 3 partitions parameters by the module that owns them (runtime/zero/partitioned_params.py):
# a unit per module, gathered before its forward and again before its backward, its gradient
# reduce-scattered when complete. A transformer block owns four weight matrices (attention's
# input and output projections, the MLP's two: GPT's qkv, proj, fc, proj; more where q, k and
# v or a gated MLP are separate, 7 in Llama); its norms fall under the persistence threshold
# and stay whole. Plus the ends: the embedding and the output layer.
STAGE3_UNITS_PER_LAYER = 4
# Of a layer's tensor and sequence collectives (communication.py), the forward's share: what
# full recomputation issues again. Megatron TP: 2 of the 4 all-reduces; with Megatron SP 2 of
# the 6 all-gathers and 2 of the 4 reduce-scatters; Ulysses: 4 of the 8 all-to-alls.
FORWARD_SHARE = {"all_reduce": 1 / 2, "reduce_scatter": 1 / 2, "all_gather": 1 / 3, "all_to_all": 1 / 2}


@dataclass(frozen=True)
class Plan:
    """One way to run a step: what `shardwise tune` searches over and `shardwise estimate`
    prints a time for. `shard_size` None: ZeRO shards over every data rank (no hybrid)."""

    stage: int
    offload: Offload = NO_OFFLOAD
    recompute: str = "none"
    parallel: ModelParallel = NO_MODEL_PARALLEL
    micro_batch: int = 1
    accumulation: int = 1
    shard_size: int | None = None
    reduce_bucket: int = DEFAULT_BUCKET_ELEMENTS
    allgather_bucket: int = DEFAULT_BUCKET_ELEMENTS
    partition_activations: bool = False  # Pa: checkpoints split over the tensor group, gathered to recompute

    def __post_init__(self) -> None:
        if self.partition_activations and self.recompute != "full":
            raise ValueError("partition_activations (Pa) splits the inputs full recomputation keeps; the time model "
                             f"prices it with recompute 'full', got {self.recompute!r}")


@dataclass(frozen=True)
class Prediction:
    plan: Plan
    time: StepTime
    tokens_per_step: int

    @property
    def step_s(self) -> float:
        return self.time.total

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.time.total


def predict(shape: ModelShape, plan: Plan, speeds: Speeds, *, num_gpus: int, gpus_per_node: int, seq_len: int,
            dtype: str, optimizer_state_bytes: float, grad_accum_dtype: str | None = None) -> Prediction:
    """Seconds per step of `plan` for `shape` on `num_gpus` devices of `speeds`; with
    `grad_accum_dtype` "fp32" beside 16-bit training, gradients summed in fp32."""
    if not shape.has_layout:
        raise ValueError("the time model needs the model's layout (hidden size, layers, heads): give --hidden-size, "
                         "--layers and --heads with --params, or a preset or config")
    work = plan_work(shape, plan, speeds, num_gpus=num_gpus, gpus_per_node=gpus_per_node, seq_len=seq_len,
                     dtype=dtype, optimizer_state_bytes=optimizer_state_bytes, grad_accum_dtype=grad_accum_dtype)
    parallel = plan.parallel
    replicas = num_gpus // (parallel.tensor * parallel.sequence * parallel.pipeline)
    tokens = replicas * plan.micro_batch * seq_len * plan.accumulation
    return Prediction(plan, step_seconds(work, speeds), tokens)


def plan_work(shape: ModelShape, plan: Plan, speeds: Speeds, *, num_gpus: int, gpus_per_node: int, seq_len: int,
              dtype: str, optimizer_state_bytes: float, grad_accum_dtype: str | None = None) -> StepWork:
    """One rank's FLOPs, collectives, update bytes, fp32 accumulation and offload traffic per step."""
    parallel, a = plan.parallel, plan.accumulation
    t, s_ulysses, p = parallel.tensor, parallel.sequence, parallel.pipeline
    layers, hidden = shape.num_layers or 1, shape.hidden_size or 1
    ebytes = element_bytes(dtype)
    flops = (training_flops_per_token(shape.num_params, layers=layers, hidden=hidden, seq_len=seq_len,
                                      recompute=plan.recompute, vocab=shape.vocab_size or 0)
             * plan.micro_batch * seq_len * a / (t * s_ulysses * p))
    local = ceil(shape.params_per_tensor_rank(t) / p)  # Ψ of this rank's replica slice
    zero_ranks = num_gpus // (t * p)
    shard = plan.shard_size or zero_ranks
    if zero_ranks % shard:
        raise ValueError(f"hybrid shard size {shard} does not divide the {zero_ranks} ZeRO ranks")
    if plan.stage == 0:
        shard = 1
    replicate = zero_ranks // shard
    data_link = speeds.inter_node if num_gpus > gpus_per_node else speeds.intra_node
    shard_link = speeds.inter_node if shard * t * p > gpus_per_node else speeds.intra_node
    padded = ceil(local / shard) * shard
    volume = comm_bytes_by_group(CommShape(padded, plan.stage, shard, replicate, ebytes, ebytes, a))
    terms: list[CommTerm] = []
    # stage 3 gathers and reduces one unit per module that owns partitioned weights; stages 1-2 by bucket
    units = STAGE3_UNITS_PER_LAYER * ceil(layers / p) + 2
    reduce_messages = units if partitions_parameters(plan.stage) else buckets(local, plan.reduce_bucket)
    if volume["shard"]["reduce_scatter"]:
        hides = "last_backward" if keeps_full_gradients(plan.stage) else "backward"
        terms.append(CommTerm("shard", "reduce_scatter", volume["shard"]["reduce_scatter"], shard, shard_link,
                              reduce_messages * (1 if keeps_full_gradients(plan.stage) else a), hides))
    if volume["shard"]["all_gather"]:
        gathered = volume["shard"]["all_gather"]
        if partitions_parameters(plan.stage):  # forward and backward, every unit each time
            terms.append(CommTerm("shard", "all_gather", gathered / 2, shard, shard_link, units * a, "forward"))
            terms.append(CommTerm("shard", "all_gather", gathered / 2, shard, shard_link, units * a, "backward"))
        else:
            terms.append(CommTerm("shard", "all_gather", gathered, shard, shard_link,
                                  buckets(local, plan.allgather_bucket)))
    if volume["replicate"]["all_reduce"]:
        hides = "last_backward" if plan.stage == 0 else "none"
        terms.append(CommTerm("replicate", "all_reduce", volume["replicate"]["all_reduce"], replicate, data_link,
                              reduce_messages, hides))
    model_shape = ParallelCommShape(layers, plan.micro_batch, seq_len, hidden, ebytes, t, s_ulysses,
                                    parallel.megatron_sp, shape.num_heads or 1, shape.num_heads or 1,
                                    accumulation_steps=a)
    for op, nbytes in tensor_parallel_comm_bytes(model_shape).items():
        if nbytes:
            terms.append(CommTerm("tensor", op, nbytes / p, t, speeds.intra_node, (2 + 4 * layers // p) * a))
    for op, nbytes in ulysses_comm_bytes(model_shape).items():
        if nbytes:
            terms.append(CommTerm("sequence", op, nbytes / p, s_ulysses, data_link, 4 * layers // p * a))
    if plan.recompute == "full":  # the layers' forward runs again, its collectives with it
        for group, bytes_of, ranks, link in (("tensor", tensor_parallel_comm_bytes, t, speeds.intra_node),
                                              ("sequence", ulysses_comm_bytes, s_ulysses, data_link)):
            for op, nbytes in _per_layer_bytes(bytes_of, model_shape).items():
                if nbytes:
                    terms.append(CommTerm(f"{group} recompute", op, nbytes * FORWARD_SHARE[op] / p, ranks, link,
                                          2 * layers // p * a))
    if plan.partition_activations and t > 1:  # each layer's kept input gathered before its recomputation
        kept = plan.micro_batch * seq_len // s_ulysses * hidden * ebytes
        terms.append(CommTerm("tensor Pa", "all_gather", layers / p * a * kept * (t - 1) / t, t, speeds.intra_node,
                              ceil(layers / p) * a))
    if p > 1:
        pipe = PipelineCommShape(plan.micro_batch, seq_len // s_ulysses, hidden // t, ebytes, p, a)
        busiest = max(pipeline_p2p_bytes(pipe, rank) for rank in range(p))
        pipe_link = speeds.inter_node if t * p > gpus_per_node else speeds.intra_node
        terms.append(CommTerm("pipeline", "send", busiest, 2, pipe_link, 2 * a))
    partition = ceil(local / zero_ranks) if partitions_optimizer(plan.stage) else local
    summed_in_fp32 = grad_accum_dtype is not None and element_bytes(grad_accum_dtype) == 4 and ebytes < 4
    update = optimizer_update_bytes(partition, grad_bytes=4 if summed_in_fp32 else ebytes,
                                    state_bytes=optimizer_state_bytes, param_bytes=ebytes, fp32_training=ebytes == 4)
    accumulation = fp32_accumulation_bytes(local=local, partition=partition, stage=plan.stage, micro_batches=a,
                                           grad_bytes=ebytes) if summed_in_fp32 else 0.0
    pcie, nvme = 0.0, 0.0
    if plan.offload.optimizer != "none":
        states = 2 if plan.offload.optimizer == "nvme" else 0
        moved = offload_transfer_bytes(partition, plan.stage, ebytes, ebytes, a, states)
        pcie = moved["device_to_host"] + moved["host_to_device"]
        nvme = (moved.get("nvme_read", 0) + moved.get("nvme_write", 0)) * min(gpus_per_node, num_gpus)
    if plan.offload.params != "none":  # every gather reads the partition from the host first
        pcie += 2 * a * partition * ebytes
        if plan.offload.params == "nvme":
            nvme += 2 * a * partition * ebytes * min(gpus_per_node, num_gpus)
    forward_fraction = 1 / 3 if plan.recompute == "none" else 1 / 4
    offloaded = plan.offload.optimizer != "none"
    return StepWork(flops, tuple(terms), a, p, optimizer_bytes=update, optimizer_on_host=offloaded,
                    accumulation_bytes=accumulation,  # stages 2-3 offloaded: the fp32 partition is the host's
                    accumulation_on_host=offloaded and not keeps_full_gradients(plan.stage), pcie_bytes=pcie,
                    nvme_bytes_per_node=nvme, forward_fraction=forward_fraction,
                    ranks_per_host=min(gpus_per_node, num_gpus))


def _per_layer_bytes(bytes_of, shape: ParallelCommShape) -> dict[str, int]:
    """Of `bytes_of(shape)`'s collectives, the layers' part (what the stack's ends do not send)."""
    ends = bytes_of(replace(shape, layers=0))
    return {op: nbytes - ends[op] for op, nbytes in bytes_of(shape).items()}


def price_options(result: "Estimate", speeds: Speeds, *, accumulation: int = 1) -> list[Prediction]:
    """A prediction for every option of `result` that fits, with the lightest recomputation
    that fits it (an option that fits nowhere has no step to time)."""
    predictions = []
    for option in result.options:
        if option.fits_with is None:
            continue
        plan = Plan(option.stage, option.offload, option.fits_with, result.parallel, result.micro_batch, accumulation)
        predictions.append(predict(result.shape, plan, speeds, num_gpus=result.hardware.num_gpus,
                                   gpus_per_node=result.hardware.gpus_per_node, seq_len=result.seq_len,
                                   dtype=result.dtype, optimizer_state_bytes=result.optimizer_state_bytes,
                                   grad_accum_dtype=result.grad_accum_dtype))
    return predictions
