"""What the formulas (docs/formulas.md) predict for a run: model-state bytes per rank and collective bytes per step.

The report and the stage-comparison figure put these beside the engine's measured
numbers. Plain arithmetic over the planner's formulas and each optimizer's K (its registry
entry), so the parent process (which draws the report) and the ranks (which write the
numbers) share one definition.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.runtime.optim.registry import optimizer_spec, registered_optimizers
from shardwise.formulas import communication
from shardwise.formulas.communication import COLLECTIVES, ring_share
from shardwise.formulas.memory import (
    element_bytes,
    expert_model_state_bytes,
    model_state_bytes,
    onebit_model_state_bytes,
)
from shardwise.formulas.stages import (
    gathers_updated_parameters,
    partitions_gradients,
    partitions_optimizer,
    partitions_parameters,
)

__all__ = [  # COLLECTIVES and ring_share are re-exported for the report
    "COLLECTIVES", "MODEL_STATES", "ExpertShape", "RunShape", "comm_expressions", "expected_comm", "expected_comm_by_group",
    "expected_memory", "memory_expressions", "optimizer_state_bytes", "ring_share",
]
MODEL_STATES = ("params", "grads", "optimizer_states")
ONEBIT = ("OneBitAdam", "OneBitLamb")  # their memory and communication have formulas of their own


@dataclass(frozen=True)
class ExpertShape:
    """An MoE model's experts split over expert groups (ep_size > 1): `params` Ψ_E, the
    elements of every expert of every MoE layer; `ep_size` P_E, the ranks of an expert
    group (each keeps Ψ_E/P_E, whole, out of ZeRO's buffers, in one bucket); `experts` E
    per MoE layer; `layers` the MoE layers; `capacity` C, the slots per expert of a
    micro-batch's all-to-all; `width` d, the model width the all-to-alls carry;
    `recomputed_layers` L_R, the MoE layers whose forward (and its two all-to-alls)
    activation checkpointing re-runs in backward, per micro-batch
    (docs/formulas.md#expert-model-states)."""

    params: int
    ep_size: int
    experts: int
    layers: int
    capacity: int
    width: int
    recomputed_layers: int = 0

    @property
    def local(self) -> int:
        """The elements of this rank's experts, Ψ_E/P_E."""
        return self.params // self.ep_size


@dataclass(frozen=True)
class RunShape:
    """The quantities the formulas need. `world_size` is the data-parallel size N;
    `shard_size` the ranks ZeRO shards over (None: N, as without hybrid sharding);
    `dtype` is the compute dtype of parameters and gradients; `comm_dtype` the dtype
    gradients are reduced in; `persistent_params` the stage-3 parameters kept whole on
    every rank; `optimizer_state_bytes` is K; `accumulation_steps` the micro-batches per
    optimizer step; `optimizer_type` the config's type (1-bit Adam / LAMB keep the
    momentum and the worker's error whole and exchange compressed momentum: their memory
    and their steps after the warm-up follow formulas of their own); `experts` the experts
    trained apart under expert parallelism (None without: a dense model, or ep_size 1,
    where ZeRO holds the experts as dense parameters); `num_params` counts them too."""

    num_params: int
    world_size: int
    stage: int
    dtype: str
    comm_dtype: str
    optimizer_state_bytes: int
    persistent_params: int = 0
    accumulation_steps: int = 1
    shard_size: int | None = None
    optimizer_type: str = "AdamW"
    bf16_masters: bool = False  # bf16 masters and optimizer states (K counts them; the report names them)
    experts: ExpertShape | None = None
    grad_dtype: str | None = None  # what gradients accumulate in where it is not `dtype` (data_types.grad_accum_dtype)

    def __post_init__(self) -> None:
        if self.experts is not None and self.onebit:
            raise ValueError(f"no formula for {self.optimizer_type} with expert parallelism: its memory and "
                             "communication formulas assume every parameter in ZeRO's buffers")

    @property
    def dense_params(self) -> int:
        """Ψ_D: the parameters ZeRO holds (every one but the experts trained apart)."""
        return self.num_params - (self.experts.params if self.experts is not None else 0)

    @property
    def expert_data_size(self) -> int:
        """N_E: the ranks holding the same experts (N/P_E)."""
        return self.world_size // self.experts.ep_size if self.experts is not None else 1

    @property
    def onebit(self) -> bool:
        return self.optimizer_type in ONEBIT

    @property
    def shard(self) -> int:
        """S: 1 at stage 0 (nothing is partitioned), else the shard group's size."""
        if not partitions_optimizer(self.stage):
            return 1
        return self.world_size if self.shard_size is None else self.shard_size

    @property
    def kept_whole(self) -> int:
        """P: the persistent parameters, kept whole on every rank where the rest are
        partitioned (stage 3); elsewhere every parameter is whole and P is not a term."""
        return self.persistent_params if partitions_parameters(self.stage) else 0

    def comm_shape(self) -> communication.CommShape:
        return communication.CommShape(
            self.dense_params, self.stage, self.shard, self.world_size // self.shard,
            element_bytes(self.comm_dtype), element_bytes(self.dtype),
            self.accumulation_steps, self.kept_whole,
        )


def optimizer_state_bytes(optimizer_type: str, dtype: str, momentum: float = 0.0, *, bf16_masters: bool = False) -> int:
    """K for a config optimizer, from its registry entry (Adam's 8, +4 master when 16-bit;
    SGD keeps a momentum buffer only when momentum is on; `bf16_masters`: 2 bytes per state, no master)."""
    if optimizer_type not in registered_optimizers():
        raise ValueError(f"no state formula for optimizer {optimizer_type!r}; known: {registered_optimizers()}")
    return optimizer_spec(optimizer_type).state_bytes_per_param({"momentum": momentum}, dtype,
                                                                bf16_masters=bf16_masters)


def expected_memory(shape: RunShape) -> dict[str, int]:
    """Model-state bytes per rank by category (docs/formulas.md#model-states-per-rank, N = the shard group's size;
    1-bit Adam / LAMB: after their warm-up, shardwise/formulas/memory.py `onebit_model_state_bytes`)."""
    if shape.onebit:
        return onebit_model_state_bytes(shape.num_params, shape.world_size, shape.stage, shape.dtype,
                                        lamb=shape.optimizer_type == "OneBitLamb", grad_dtype=shape.grad_dtype)
    dense = model_state_bytes(
        shape.dense_params,
        shape.shard if partitions_optimizer(shape.stage) else shape.world_size,
        shape.stage,
        shape.dtype,
        shape.optimizer_state_bytes,
        shape.kept_whole,
        grad_dtype=shape.grad_dtype,
    )
    if shape.experts is None:
        return dense
    experts = expert_model_state_bytes(bucket_numels=[shape.experts.local], expert_data_size=shape.expert_data_size,
                                       stage=shape.stage, dtype=shape.dtype,
                                       state_bytes_per_element=shape.optimizer_state_bytes)
    return {category: dense[category] + experts[category] for category in MODEL_STATES}


def expected_comm(shape: RunShape) -> dict[str, int]:
    """Collective bytes per rank per optimizer step (docs/formulas.md#communication-per-step, planner/communication.py);
    1-bit Adam / LAMB: a step after the warm-up (no gradient reduced, the compressed
    momentum exchange, and at stages 1-2 the parameters' all-gather)."""
    if shape.onebit:
        volume = dict.fromkeys(COLLECTIVES, 0)
        volume.update(communication.onebit_exchange_bytes(shape.num_params, shape.world_size, shape.stage,
                                                          element_bytes(shape.dtype)))
        return volume
    volume = communication.comm_bytes(shape.comm_shape())
    if shape.experts is None:
        return volume
    experts = shape.experts
    for op, nbytes in communication.expert_gradient_bytes(
            bucket_numels=[experts.local], expert_data_size=shape.expert_data_size, stage=shape.stage,
            param_bytes=element_bytes(shape.dtype)).items():
        volume[op] += nbytes
    exchange = dict(experts=experts.experts, capacity=experts.capacity, width=experts.width,
                    bytes_per_element=element_bytes(shape.dtype), ep_size=experts.ep_size)
    volume["all_to_all"] = shape.accumulation_steps * (
        communication.moe_all_to_all_bytes(**exchange, layers=experts.layers)
        + communication.moe_all_to_all_bytes(**exchange, layers=experts.recomputed_layers, backward=False))
    return volume


def expected_comm_by_group(shape: RunShape) -> dict[str, dict[str, int]]:
    return communication.comm_bytes_by_group(shape.comm_shape())


def memory_expressions(shape: RunShape) -> dict[str, str]:
    """The formula's term behind each memory category, e.g. "4Ψ/N" or "2Ψ/N + 2P"."""
    p, k = element_bytes(shape.dtype), shape.optimizer_state_bytes
    g = element_bytes(shape.grad_dtype or shape.dtype)
    if shape.onebit:
        return _onebit_memory_expressions(shape, p)
    params = f"{p}Ψ"
    if partitions_parameters(shape.stage):
        params = f"{p}(Ψ−P)/N + {p}P" if shape.persistent_params else f"{p}Ψ/N"
    dense = {
        "params": params,
        "grads": f"{g}Ψ/N" if partitions_gradients(shape.stage) else f"{g}Ψ",
        "optimizer_states": f"{k}Ψ/N" if partitions_optimizer(shape.stage) else f"{k}Ψ",
    }
    if shape.experts is None:
        return dense
    return _with_experts(dense, _expert_memory_expressions(shape, p, k))


def _expert_slice(shape: RunShape) -> tuple[int, str]:
    """(N_E where the experts' bucket is split, else 1; the slice a rank steps, W)."""
    parts = shape.expert_data_size if partitions_optimizer(shape.stage) else 1
    return parts, "Ψ_E/P_E" if parts == 1 else "⌈Ψ_E/(P_E·N_E)⌉"


def _expert_memory_expressions(shape: RunShape, p: int, k: int) -> dict[str, str]:
    """The experts' terms (shardwise/formulas/memory.py `expert_model_state_bytes`): the
    grads term is the larger of the whole local gradients and the fp32 slice kept after
    the reduction."""
    parts, slice_ = _expert_slice(shape)
    local = shape.experts.local
    whole_grads = p * local >= 4 * -(-local // parts)
    return {"params": f"{p}Ψ_E/P_E" if parts == 1 else f"{p}N_E·{slice_}",
            "grads": f"{p}Ψ_E/P_E" if whole_grads else f"4{slice_}",
            "optimizer_states": f"{k}{slice_}"}


def _with_experts(dense: dict[str, str], experts: dict[str, str]) -> dict[str, str]:
    """The dense terms over Ψ_D, the experts' added."""
    joined = {key: value.replace("Ψ", "Ψ_D") for key, value in dense.items()}
    for key, term in experts.items():
        joined[key] = f"{joined[key]} + {term}" if joined.get(key) else term
    return joined


def comm_expressions(shape: RunShape) -> dict[str, str]:
    """The formula's term behind each collective's bytes per step ("" where nothing is sent);
    A is the number of micro-batches per step."""
    if shape.onebit:
        framed = "(L/8 + 4N)(N−1)/N"
        parameters = f" + {element_bytes(shape.dtype)}Ψ(N−1)/N" if gathers_updated_parameters(shape.stage) else ""
        gather = framed + parameters
        return {**dict.fromkeys(COLLECTIVES, ""), "all_to_all": framed, "all_gather": gather}
    dense = communication.comm_expressions(shape.comm_shape())
    if shape.experts is None:
        return dense
    return _with_experts(dense, _expert_comm_expressions(shape))


def _expert_comm_expressions(shape: RunShape) -> dict[str, str]:
    """The experts' gradient reduction over N_E ranks (fp32, once per step), the updated
    slices' all-gather, and the all-to-alls of every MoE layer per micro-batch (and of
    the recomputed ones' forward again)."""
    p = element_bytes(shape.dtype)
    per_micro = "A·" if shape.accumulation_steps > 1 else ""
    layers = "(4·L_E + 2·L_R)" if shape.experts.recomputed_layers else "4·L_E"
    terms = {"all_to_all": f"{per_micro}{layers}·E·C·d·{p}(P_E−1)/P_E"}
    if shape.expert_data_size == 1:
        return terms
    ring = "(N_E−1)/N_E"
    if not partitions_optimizer(shape.stage):
        return {**terms, "all_reduce": f"2·4(Ψ_E/P_E){ring}"}
    _, slice_ = _expert_slice(shape)
    return {**terms, "reduce_scatter": f"4N_E·{slice_}{ring}", "all_gather": f"{p}N_E·{slice_}{ring}"}


def _onebit_memory_expressions(shape: RunShape, p: int) -> dict[str, str]:
    """1-bit Adam / LAMB after the warm-up: stage 0 every state whole and the server's error
    1/N; stages 1-2 the momentum and the worker's error (8Ψ) whole, the master, variance(s)
    and server error partitioned; stage 2's gradients add the whole local gradient."""
    master = 0 if p == 4 else 4
    variances = 8 if shape.optimizer_type == "OneBitLamb" else 4
    if not partitions_optimizer(shape.stage):
        return {"params": f"{p}Ψ", "grads": f"{p}Ψ", "optimizer_states": f"{master + variances + 8}Ψ + 4Ψ/N"}
    grads = f"{p}Ψ + {p}Ψ/N" if partitions_gradients(shape.stage) else f"{p}Ψ"
    return {"params": f"{p}Ψ", "grads": grads, "optimizer_states": f"8Ψ + {master + variances + 4}Ψ/N"}
