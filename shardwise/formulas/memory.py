"""Memory formulas: ZeRO model states, their offloaded placement, and activations.

Everything here is integer arithmetic with no torch import, so the engine's measured
`memory_breakdown()` can be checked against the very numbers `shardwise estimate` prints.

Notation (docs/formulas.md#notation): Ψ parameters, N data-parallel ranks, K bytes of optimizer state per
parameter. ZeRO (Rajbhandari et al., 2020) removes the data-parallel redundancy one model
state at a time: stage 1 partitions the optimizer states (KΨ → KΨ/N), stage 2 also the
gradients, stage 3 also the 16-bit parameters. A partition is ceil(Ψ/N) elements: the
engine pads the flat buffer so every rank holds the same length.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil
from typing import Callable, Literal

from shardwise.formulas.stages import (
    check_stage,
    keeps_full_gradients,
    partitions_gradients,
    partitions_optimizer,
    partitions_parameters,
)

Device = Literal["gpu", "cpu", "nvme"]
OffloadDevice = Literal["none", "cpu", "nvme"]
Category = Literal["params", "grads", "optimizer_states"]
RecomputeMode = Literal["none", "selective", "full"]

GB = 10**9

CATEGORIES: tuple[Category, ...] = ("params", "grads", "optimizer_states")
RECOMPUTE_MODES: tuple[RecomputeMode, ...] = ("none", "selective", "full")

ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
MASTER_WEIGHT_BYTES = 4
# Offloaded gradients are kept in fp32 on the host: the CPU optimizer steps in fp32, so
# the 16-bit gradient partition is upcast once on arrival instead of at every use.
HOST_GRADIENT_BYTES = 4
# Adam's fp32 state per parameter (momentum and variance): the ZeRO paper's K = 12 with the
# master copy, and the K the formulas assume when none is given. Every optimizer's own count
# is in its registry entry (shardwise/runtime/optim/registry.py), passed here as a number.
ADAM_FP32_STATES = 2
# The model-state summands of an optimizer whose states do not all partition like ZeRO's
# (1-bit Adam / LAMB: `onebit_state_terms`), given the stage, the dtype and the dtype
# gradients accumulate in (None: the training dtype).
OwnStateTerms = Callable[[int, str, "str | None"], "list[StateTerm]"]


def element_bytes(dtype: str) -> int:
    """Bytes of one parameter or gradient element in the training dtype."""
    if dtype not in ELEMENT_BYTES:
        raise ValueError(f"dtype must be one of {sorted(ELEMENT_BYTES)}, got {dtype!r}")
    return ELEMENT_BYTES[dtype]


def optimizer_state_bytes(fp32_states: float, dtype: str = "bf16", *, bf16_masters: bool = False) -> float:
    """K for an optimizer keeping `fp32_states` fp32 tensors of state per parameter (or their
    byte equivalent / 4): with 16-bit training the optimizer owns an fp32 master copy (4
    bytes) on top of its own states; with fp32 training it updates the fp32 weights in
    place, so K is the states alone (Adam, 2 states: 12 mixed, 8 fp32). `bf16_masters`
    (DeepSpeed's bf16_master_weights_and_grads with bf16_optimizer_states): the bf16
    partition is its own master and the states are bf16, so K is 2 bytes per state
    (Adam: 4, a third of mixed precision's 12)."""
    if fp32_states < 0:
        raise ValueError(f"fp32_states must be >= 0, got {fp32_states}")
    if bf16_masters:
        if dtype != "bf16":
            raise ValueError(f"bf16 masters need bf16 training, got dtype {dtype!r}")
        return element_bytes(dtype) * fp32_states
    master = 0 if element_bytes(dtype) == MASTER_WEIGHT_BYTES else MASTER_WEIGHT_BYTES
    return 4 * fp32_states + master


def expert_optimizer_state_bytes(*, bucket_numels: list[int], expert_data_size: int, state_bytes_per_element: int,
                                 partitioned: bool) -> int:
    """Bytes of the experts' optimizer state on one rank (docs/formulas.md#expert-parallelism):
    each bucket (a param group's experts of one expert-parallel size, `bucket_numels`
    elements on this rank) is padded to a multiple of the expert-data size N and split N
    ways at ZeRO >= 1 (`partitioned`), whole at stage 0; K = `state_bytes_per_element`
    (8 for fp32 Adam: two fp32 moments; 12 for bf16 Adam: and the fp32 master)."""
    parts = expert_data_size if partitioned else 1
    return sum(ceil(numel / parts) * state_bytes_per_element for numel in bucket_numels)


def expert_model_state_bytes(*, bucket_numels: list[int], expert_data_size: int, stage: int, dtype: str,
                             state_bytes_per_element: int) -> dict[str, int]:
    """Bytes of the local experts' model states on one rank, by category, under expert
    parallelism (docs/formulas.md#expert-model-states): the rank keeps its experts whole at
    every stage, out of ZeRO's flat buffers. A bucket (a param group's experts of one
    expert-parallel size, `bucket_numels` elements here) of G elements is padded to N·W at
    ZeRO >= 1, W = ⌈G/N⌉ over the expert-data size N (W = G, no padding, at stage 0):

        params            p·Σ N·W          the bucket's flat buffer, padding included
        grads             max over k of  p·Σ_{b>k} G_b + 4·Σ_{b<=k} W_b
                                           each expert's whole p-byte gradient until its
                                           bucket is reduced; then the bucket's fp32 slice
                                           of the sum (buckets reduced in order)
        optimizer_states  K·Σ W            the optimizer steps the slice

    p: bytes per element of `dtype`; K = `state_bytes_per_element`."""
    check_stage(stage)
    p = element_bytes(dtype)
    parts = expert_data_size if partitions_optimizer(stage) else 1
    slices = [ceil(numel / parts) for numel in bucket_numels]
    held = [p * sum(bucket_numels[reduced:]) + 4 * sum(slices[:reduced]) for reduced in range(len(slices) + 1)]
    return {"params": p * parts * sum(slices), "grads": max(held),
            "optimizer_states": state_bytes_per_element * sum(slices)}


def onebit_state_bytes(numel: int, ranks: int, lamb: bool = False, keeps_signs: bool = False) -> int:
    """1-bit Adam's (`lamb`: 1-bit LAMB's) fp32 state for `numel` trained elements after the
    warm-up, at stage 0 over `ranks` data-parallel ranks: momentum and variance (LAMB: also
    its fresh variance) per element, and once there are ranks to exchange with, the momentum
    buffer padded to whole bytes per rank (L = numel rounded up to a multiple of 8·ranks),
    the worker's error buffer (L) and the server's (L / ranks). `keeps_signs`: the fused
    CPU step (the native kernels) keeps the last exchange's gathered message, one bit per
    element and each rank's fp32 scale (L/8 + 4·ranks bytes), plus the scales apart
    (4·ranks), to read the previous momentum from at the next step."""
    moments = 4 * (3 if lamb else 2) * numel
    if ranks == 1:
        return moments
    padded = ceil(numel / (8 * ranks)) * 8 * ranks
    signs = padded // 8 + 8 * ranks if keeps_signs else 0
    return moments + 4 * ((padded - numel) + padded + padded // ranks) + signs


def onebit_partitioned_state_bytes(owned: int, partition: int, ranks: int, lamb: bool = False) -> int:
    """1-bit Adam's (`lamb`: 1-bit LAMB's) fp32 state at ZeRO stages 1-2 after the warm-up,
    without the master copy: the frozen variance (LAMB: also the fresh one) of the rank's
    `owned` trained elements, the whole momentum (`ranks` rows of `partition` elements, a
    rank's partition padded to whole bytes: the momentum is not partitioned, each worker
    compresses all of it), the worker's error buffer (as long) and the server's (one row)."""
    return 4 * ((2 if lamb else 1) * owned + 2 * ranks * partition + partition)


def zero_one_adam_state_bytes(numel: int, ranks: int) -> int:
    """0/1 Adam's fp32 state for `numel` trained elements at stage 0 over `ranks` ranks, once
    it has exchanged: momentum, variance and the accumulated update u per element, u's flat
    buffer padded to whole bytes per rank (L = numel rounded up to a multiple of 8·ranks),
    and with ranks to exchange with the worker's error buffer (L) and the server's (L / ranks)."""
    padded = ceil(numel / (8 * ranks)) * 8 * ranks
    errors = padded + padded // ranks if ranks > 1 else 0
    return 4 * (3 * numel + (padded - numel) + errors)


def zero_one_adam_state_terms(stage: int, dtype: str, grad_dtype: str | None = None) -> list[StateTerm]:
    """`zero_one_adam_state_bytes` as summands (padding aside), stage 0 only (DeepSpeed runs
    0/1 Adam without ZeRO): the master, momentum, variance, accumulated update and worker
    error whole, the server error 1/N; the gradients in `grad_dtype` where they accumulate
    in another dtype than the training one."""
    if stage != 0:
        raise ValueError(f"0/1 Adam runs at ZeRO stage 0 only, not {stage} (runtime/optim/zero_one_adam.py)")
    p = element_bytes(dtype)
    master = 0 if p == MASTER_WEIGHT_BYTES else MASTER_WEIGHT_BYTES
    return [StateTerm("params", "params", "gpu", p, sharded=False),
            StateTerm("grads", "grads", "gpu", element_bytes(grad_dtype or dtype), sharded=False),
            StateTerm("optimizer + accumulated update + worker error", "optimizer_states", "gpu", master + 16,
                      sharded=False),
            StateTerm("server error", "optimizer_states", "gpu", 4, sharded=True)]


def _check_onebit_stage(stage: int) -> None:
    """1-bit Adam / LAMB keep the whole momentum, the worker's error and the whole local
    gradient on every rank, more than partitioning the parameters would save: stages 0-2
    (runtime/optim/onebit.py: why not 3)."""
    if partitions_parameters(stage):
        raise ValueError(f"1-bit Adam / LAMB run at ZeRO stages 0-2, not {stage}")

def onebit_state_terms(stage: int, dtype: str, lamb: bool = False, *,
                       grad_dtype: str | None = None) -> list[StateTerm]:
    """`onebit_model_state_bytes` as summands (padding aside), for the estimator: stage 0
    every state whole but the server's error; stages 1-2 the momentum and the worker's
    error (8 bytes) whole, the master, the variance(s) and the server's error sharded;
    stage 2's gradients its partition plus the whole local gradient, both in `grad_dtype`
    where gradients accumulate in another dtype than the training one."""
    _check_onebit_stage(stage)
    p = element_bytes(dtype)
    g = element_bytes(grad_dtype or dtype)
    master = 0 if p == MASTER_WEIGHT_BYTES else MASTER_WEIGHT_BYTES
    variances = 8 if lamb else 4
    terms = [StateTerm("params", "params", "gpu", p, sharded=False),
             StateTerm("grads", "grads", "gpu", g, sharded=False)]
    if partitions_gradients(stage):
        terms.append(StateTerm("grad partition", "grads", "gpu", g, sharded=True))
    if not partitions_optimizer(stage):
        terms.append(StateTerm("optimizer + momentum + worker error", "optimizer_states", "gpu",
                               master + variances + 8, sharded=False))
    else:
        terms.append(StateTerm("momentum + worker error", "optimizer_states", "gpu", 8, sharded=False))
        terms.append(StateTerm("optimizer", "optimizer_states", "gpu", master + variances, sharded=True))
    terms.append(StateTerm("server error", "optimizer_states", "gpu", 4, sharded=True))
    return terms


def onebit_model_state_bytes(num_params: int, ranks: int, stage: int, dtype: str = "bf16",
                             lamb: bool = False, *, grad_dtype: str | None = None) -> dict[str, int]:
    """Model-state bytes per rank with 1-bit Adam / LAMB after the warm-up (padding aside),
    per category as `memory_breakdown()` reports them. Stage 0 keeps everything whole plus
    the server's 1/N error; stages 1-2 partition the master, the variance(s) and the server
    error but keep the momentum and the worker's error whole: optimizer states
    (4 + 4 + 4 [+4 LAMB] + 4)Ψ/N + 8Ψ with 16-bit training (no master in fp32), i.e. K
    per partitioned element plus 8 bytes per parameter on every rank. Stage 2's gradients:
    its partition and, from the freeze on, the whole local gradient the exchange folds
    (stage 1's full buffer serves both), in `grad_dtype` where gradients accumulate in
    another dtype than the training one. Stage 3 is not supported (optim/onebit.py)."""
    _check_onebit_stage(stage)
    p = element_bytes(dtype)
    g = element_bytes(grad_dtype or dtype)
    master = 0 if p == MASTER_WEIGHT_BYTES else MASTER_WEIGHT_BYTES
    if not partitions_optimizer(stage) or ranks == 1:
        states = master * num_params + onebit_state_bytes(num_params, ranks, lamb)
        return {"params": p * num_params, "grads": g * num_params, "optimizer_states": states}
    part = num_params // ranks
    states = master * part + onebit_partitioned_state_bytes(part, ceil(part / 8) * 8, ranks, lamb)
    grads = g * num_params + (g * part if partitions_gradients(stage) else 0)
    return {"params": p * num_params, "grads": grads, "optimizer_states": states}


@dataclass(frozen=True)
class Offload:
    """Where the optimizer (fp32 master, states, fp32 gradients) and the 16-bit parameters
    live, in the vocabulary of the config's `offload_optimizer.device` / `offload_param.device`."""

    optimizer: OffloadDevice = "none"
    params: OffloadDevice = "none"

    @property
    def label(self) -> str:
        if self.params != "none" and self.params == self.optimizer:
            return f"optimizer+params→{self.optimizer}"
        if self.params != "none":
            return f"optimizer→{self.optimizer}, params→{self.params}"
        if self.optimizer != "none":
            return f"optimizer→{self.optimizer}"
        return "none"


NO_OFFLOAD = Offload()


@dataclass(frozen=True)
class StateTerm:
    """One summand of a model-state formula: `bytes_per_param`·Ψ, or ·Ψ/N when `sharded`.
    `label` names it in explanations ("fp32 master" is counted under optimizer_states)."""

    label: str
    category: Category
    device: Device
    bytes_per_param: int
    sharded: bool


def validate_placement(stage: int, offload: Offload) -> None:
    """ZeRO-Offload needs partitioned optimizer states (stage ≥ 1), on the host or swapped
    to NVMe (shardwise's NVMe tier pages the optimizer partition at stages 1-3); parameter
    offload needs partitioned parameters (stage 3), with or without the optimizer offloaded
    (alone, the shards live on the host and the masters and states on the device)."""
    check_stage(stage)
    for name, device in (("optimizer", offload.optimizer), ("params", offload.params)):
        if device not in ("none", "cpu", "nvme"):
            raise ValueError(f"offload {name} device must be none, cpu or nvme, got {device!r}")
    if not partitions_optimizer(stage) and offload != NO_OFFLOAD:
        raise ValueError("offload needs ZeRO stage 1 or more; stage 0 keeps every state on the GPU")
    if not partitions_parameters(stage) and offload.params != "none":
        raise ValueError(f"parameter offload needs stage 3, got stage {stage}")


def model_state_terms(stage: int, offload: Offload, dtype: str, optimizer_state_bytes: int,
                      own_terms: OwnStateTerms | None = None, *, grad_dtype: str | None = None) -> list[StateTerm]:
    """The per-rank model-state formula as summands, each placed on a device.

    Without offload these are exactly the rows of docs/formulas.md#model-states-per-rank. With the optimizer offloaded
    (ZeRO-Offload, Ren et al. 2021) the optimizer partition and an fp32 gradient partition
    live on the host and the step runs there; stage 1 still accumulates the full 16-bit
    gradient on the GPU because it reduces only at the boundary, while stages 2-3 stream
    each reduced gradient bucket straight to the host and keep none. With NVMe
    (ZeRO-Infinity) the optimizer partition is swapped to files and the gradient partition
    stays in host memory, where the optimizer consumes it sub-group by sub-group. fp32
    training has no master copy on the GPU, but an offloaded optimizer needs its own fp32
    copy of the weight partition to update, so one is added beside it.

    `own_terms`: an optimizer's own summands (1-bit Adam / LAMB), which keep every state on
    the device. `grad_dtype`: the dtype gradients accumulate in when it is not the training
    dtype (DeepSpeed's `data_types.grad_accum_dtype` fp32 beside bf16/fp16): the device's
    gradient buffers take its g bytes per element instead of p (docs/formulas.md#fp32-gradient-accumulation).
    """
    if own_terms is not None:
        if offload != NO_OFFLOAD:
            raise ValueError("this optimizer keeps its state on the device: no offload")
        return own_terms(stage, dtype, grad_dtype)
    validate_placement(stage, offload)
    p = element_bytes(dtype)
    g = element_bytes(grad_dtype or dtype)
    gpu: Device = "gpu"
    param_device: Device = gpu if offload.params == "none" else offload.params
    terms = [StateTerm("params", "params", param_device, p, sharded=partitions_parameters(stage))]
    if offload.optimizer == "none":
        terms.append(StateTerm("grads", "grads", gpu, g, sharded=partitions_gradients(stage)))
        terms.append(StateTerm("optimizer", "optimizer_states", gpu, optimizer_state_bytes,
                                sharded=partitions_optimizer(stage)))
        return terms
    if keeps_full_gradients(stage):  # stage 1: it reduces only at the boundary
        terms.append(StateTerm("grads", "grads", gpu, g, sharded=False))
    terms.append(StateTerm("fp32 grads", "grads", "cpu", HOST_GRADIENT_BYTES, sharded=True))
    if p == MASTER_WEIGHT_BYTES:
        terms.append(StateTerm("fp32 master", "optimizer_states", offload.optimizer, MASTER_WEIGHT_BYTES, sharded=True))
    terms.append(StateTerm("optimizer", "optimizer_states", offload.optimizer, optimizer_state_bytes, sharded=True))
    return terms


def partition_elements(num_elements: int, world_size: int) -> int:
    """Elements one rank holds of a flat buffer padded to a multiple of N."""
    return ceil(num_elements / world_size)


def placed_model_state_bytes(
    num_params: int,
    world_size: int,
    stage: int,
    offload: Offload = NO_OFFLOAD,
    *,
    dtype: str = "bf16",
    optimizer_state_bytes_per_param: int | None = None,
    persistent_params: int = 0,
    own_terms: OwnStateTerms | None = None,
    frozen_params: int = 0,
    grad_dtype: str | None = None,
) -> dict[Device, dict[Category, int]]:
    """Model-state bytes one rank holds, per device and category. `num_params` are the
    trained parameters; `frozen_params` more (LoRA's base weights) take their b bytes
    only, whole at stages 0-2 and 1/N at stage 3, where the parameters live.

    Stage-3 persistent parameters (small ones the engine never partitions, so it need not
    gather them) are held in full by every rank, on the GPU even when the rest is offloaded.
    `own_terms`: an optimizer's own summands (`model_state_terms`). `grad_dtype`: the
    gradients' accumulation dtype where it is not `dtype` (`model_state_terms`).
    """
    _check_counts(num_params, world_size, persistent_params)
    k = _resolve_k(dtype, optimizer_state_bytes_per_param)
    placed: dict[Device, dict[Category, int]] = {d: dict.fromkeys(CATEGORIES, 0) for d in ("gpu", "cpu", "nvme")}
    for term in model_state_terms(stage, offload, dtype, k, own_terms, grad_dtype=grad_dtype):
        if term.category == "params" and term.sharded:
            placed[term.device]["params"] += term.bytes_per_param * partition_elements(num_params - persistent_params, world_size)
            placed["gpu"]["params"] += term.bytes_per_param * persistent_params
            continue
        elements = partition_elements(num_params, world_size) if term.sharded else num_params
        placed[term.device][term.category] += term.bytes_per_param * elements
    if frozen_params:
        frozen = frozen_state_term(stage, offload, dtype)
        elements = partition_elements(frozen_params, world_size) if frozen.sharded else frozen_params
        placed[frozen.device]["params"] += frozen.bytes_per_param * elements
    return placed


def frozen_state_term(stage: int, offload: Offload, dtype: str) -> StateTerm:
    """Frozen parameters: b bytes each where the parameters live, 1/N at stage 3."""
    device: Device = "gpu" if offload.params == "none" else offload.params
    return StateTerm("frozen params", "params", device, element_bytes(dtype), sharded=partitions_parameters(stage))


def offloaded_partition_elements(unit_partitions: list[int], ratio: float) -> int:
    """`offload_optimizer.ratio` (ZeRO-Offload++ Twin-Flow): elements of a rank's partition
    updated in the offload tier. The units keep their order: the leading ones stay on the
    device up to the unit boundary nearest to (1 - ratio)·partition (ties: more offloaded),
    the trailing ones are offloaded, so the offloaded fraction is `ratio` to within a unit."""
    if not 0 <= ratio <= 1:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    total = sum(unit_partitions)
    target = (1 - ratio) * total
    prefixes = [0]
    for numel in unit_partitions:
        prefixes.append(prefixes[-1] + numel)
    kept = min(prefixes, key=lambda prefix: (abs(prefix - target), prefix))
    return total - kept


def placed_partial_offload_bytes(
    num_params: int,
    world_size: int,
    stage: int,
    offload: Offload,
    offloaded_elements: int,
    *,
    dtype: str = "bf16",
    optimizer_state_bytes_per_param: int | None = None,
    persistent_params: int = 0,
    grad_dtype: str | None = None,
) -> dict[Device, dict[Category, int]]:
    """Model-state bytes per device and category when only `offloaded_elements` of the
    ceil(Ψ/N) partition are offloaded: that part is placed as with full offload, the rest
    as without (its gradient partition, stage ≥ 2, and its K bytes of state stay on the
    GPU; fp32 training updates it in place, with no master copy). `grad_dtype`: the
    gradients' accumulation dtype where it is not `dtype`."""
    k = _resolve_k(dtype, optimizer_state_bytes_per_param)
    partition = partition_elements(num_params, world_size)
    if not 0 <= offloaded_elements <= partition:
        raise ValueError(f"offloaded_elements must be in [0, {partition}], got {offloaded_elements}")
    placed = placed_model_state_bytes(num_params, world_size, stage, offload, dtype=dtype,
                                      optimizer_state_bytes_per_param=k, persistent_params=persistent_params,
                                      grad_dtype=grad_dtype)
    kept = partition - offloaded_elements
    for term in model_state_terms(stage, offload, dtype, k, grad_dtype=grad_dtype):
        if term.category != "params" and term.sharded:
            placed[term.device][term.category] -= term.bytes_per_param * kept
    if partitions_gradients(stage):
        placed["gpu"]["grads"] += element_bytes(grad_dtype or dtype) * kept
    placed["gpu"]["optimizer_states"] += k * kept
    return placed


def model_state_bytes(
    num_params: int,
    world_size: int,
    stage: int,
    dtype: str = "bf16",
    optimizer_state_bytes_per_param: int | None = None,
    persistent_params: int = 0,
    *,
    grad_dtype: str | None = None,
) -> dict[str, int]:
    """Per-rank bytes of {"params", "grads", "optimizer_states"} with no offload: docs/formulas.md#model-states-per-rank.

    `optimizer_state_bytes_per_param` is K; it defaults to Adam's (12 mixed, 8 fp32).
    `grad_dtype`: the gradients' accumulation dtype where it is not `dtype`.
    """
    return dict(placed_model_state_bytes(
        num_params, world_size, stage, NO_OFFLOAD, dtype=dtype,
        optimizer_state_bytes_per_param=optimizer_state_bytes_per_param, persistent_params=persistent_params,
        grad_dtype=grad_dtype,
    )["gpu"])


def hpz_secondary_bytes(num_params: int, partition_size: int, dtype: str = "bf16") -> int:
    """ZeRO++'s hpZ (C28, docs/formulas.md#hpz-secondary-partition): each rank keeps, beside
    its 1/N primary partition, a secondary partition of the 16-bit parameters over
    `partition_size` = H ranks of its node, pΨ/H bytes (Ψ padded as the engine pads it, a
    multiple of N, so of H). With H = N/n for n nodes this is n times the primary
    partition: stage 3's params become pΨ/N + pΨ/H, the paper's price for gathering only
    inside the node in backward."""
    if partition_size < 1 or num_params % partition_size:
        raise ValueError(f"hpZ partition size {partition_size} must be >= 1 and divide the {num_params} padded "
                         "parameters")
    return 0 if partition_size == 1 else num_params * element_bytes(dtype) // partition_size


def _resolve_k(dtype: str, explicit: int | None) -> int:
    """K as given, or Adam's K for the dtype."""
    if explicit is None:
        return optimizer_state_bytes(ADAM_FP32_STATES, dtype)
    if explicit < 0:
        raise ValueError(f"optimizer_state_bytes_per_param must be >= 0, got {explicit}")
    return explicit


def _check_counts(num_params: int, world_size: int, persistent_params: int) -> None:
    if num_params <= 0:
        raise ValueError(f"num_params must be positive, got {num_params}")
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if not 0 <= persistent_params <= num_params:
        raise ValueError(f"persistent_params must be in [0, num_params={num_params}], got {persistent_params}")
