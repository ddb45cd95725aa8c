"""Communication formulas: bytes one rank sends per optimizer step, per group (docs/formulas.md#communication-per-step).

Plain integer arithmetic, no torch: the estimator, the main job's report and the tests
that check the engine's own count (`engine.comm_volume(per_group=True)`) to the byte all
use these functions.

Ring model: all-reduce of S bytes over n ranks sends 2S(n−1)/n; all-gather or
reduce-scatter of a full S sends S(n−1)/n.

Notation: Ψ parameters (padded as the engine pads them), A micro-batches per step, g bytes
per communicated gradient element, p bytes per parameter element, P stage-3 parameters
kept whole (persistent). ZeRO shards over a group of S ranks; hybrid sharding
(`mics_shard_size`) replicates those shards over R groups, N = S·R. Stage 0 is S = 1,
R = N; plain ZeRO 1-3 is S = N, R = 1.

    shard group (S)       reduce-scatter   Ψg(S−1)/S, once per step (stage 1) or per
                                           micro-batch (stages 2-3, which keep only a partition)
                          all-gather       Ψp(S−1)/S after the update (stages 1-2);
                                           stage 3: 2(Ψ−P)p(S−1)/S per micro-batch (forward
                                           and backward) + Pp(S−1)/S after the update
    replicate group (R)   all-reduce       2(Ψ/S)g(R−1)/R once per step: the owned 1/S
                                           slice, after the window's last reduce-scatter

With R = 1 these are the ZeRO paper's: 2Ψ(N−1)/N for stages 0-2 (a reduce-scatter and
an all-gather are one all-reduce), 3Ψ(N−1)/N for stage 3.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardwise.formulas.stages import (
    gathers_updated_parameters,
    keeps_full_gradients,
    partitions_optimizer,
    partitions_parameters,
)

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def ring_share(num_elements: int, bytes_per_element: int, ranks: int) -> int:
    """Bytes one rank sends to all-gather or reduce-scatter `num_elements` over `ranks`."""
    return num_elements * bytes_per_element * (ranks - 1) // ranks


@dataclass(frozen=True)
class CommShape:
    num_params: int  # Ψ, padded
    stage: int
    shard_size: int  # S
    replicate_size: int  # R
    grad_bytes: int  # g
    param_bytes: int  # p
    accumulation_steps: int = 1  # A
    persistent_params: int = 0  # P (stage 3)


def comm_bytes_by_group(shape: CommShape) -> dict[str, dict[str, int]]:
    """{"shard": {...}, "replicate": {...}}: bytes per collective per step."""
    psi, s, r, a = shape.num_params, shape.shard_size, shape.replicate_size, shape.accumulation_steps
    g, p = shape.grad_bytes, shape.param_bytes
    shard = dict.fromkeys(COLLECTIVES, 0)
    replicate = dict.fromkeys(COLLECTIVES, 0)
    if s > 1:
        shard["reduce_scatter"] = (1 if keeps_full_gradients(shape.stage) else a) * ring_share(psi, g, s)
        if partitions_parameters(shape.stage):
            persistent = shape.persistent_params
            shard["all_gather"] = a * 2 * ring_share(psi - persistent, p, s) + ring_share(persistent, p, s)
        else:
            shard["all_gather"] = ring_share(psi, p, s)
    if r > 1:
        replicate["all_reduce"] = 2 * ring_share(psi // s, g, r)
    return {"shard": shard, "replicate": replicate}


def comm_bytes(shape: CommShape) -> dict[str, int]:
    """Bytes per collective per step, summed over groups."""
    totals = dict.fromkeys(COLLECTIVES, 0)
    for group in comm_bytes_by_group(shape).values():
        for op, nbytes in group.items():
            totals[op] += nbytes
    return totals


def comm_expressions(shape: CommShape) -> dict[str, str]:
    """The term behind each collective's bytes per step ("" where nothing is sent), in the
    notation above, e.g. {"all_gather": "2pΨ(N−1)/N", ...} for the report."""
    g, p = shape.grad_bytes, shape.param_bytes
    s, r = shape.shard_size, shape.replicate_size
    shard_ring = "(N−1)/N" if r == 1 else "(S−1)/S"
    expressions = dict.fromkeys(COLLECTIVES, "")
    if s == 1:
        expressions["all_reduce"] = f"2·{g}Ψ(N−1)/N"
        return expressions
    per_micro = "A·" if shape.accumulation_steps > 1 else ""
    expressions["reduce_scatter"] = f"{'' if keeps_full_gradients(shape.stage) else per_micro}{g}Ψ{shard_ring}"
    gather = f"{p}Ψ{shard_ring}"
    if partitions_parameters(shape.stage):
        gather = (f"({per_micro}2(Ψ−P) + P)·{p}{shard_ring}" if shape.persistent_params
                  else f"{per_micro}2·{p}Ψ{shard_ring}")
    expressions["all_gather"] = gather
    if r > 1:
        expressions["all_reduce"] = f"2·{g}(Ψ/S)(R−1)/R"
    return expressions


def offload_transfer_bytes(partition: int, stage: int, grad_bytes: int, param_bytes: int,
                           accumulation_steps: int = 1, state_tensors: int = 0) -> dict[str, int]:
    """Bytes one rank moves between tiers per step with its optimizer offloaded, for a
    partition of `partition` (= Ψ/N, padded) elements.

    device -> host: each reduced gradient chunk, every micro-batch at stages 2-3 (they keep
    no partition on the device), once at stage 1 (it reduces at the boundary);
    host -> device: the updated parameters' chunk, once; NVMe (`state_tensors` > 0): the
    fp32 master and the optimizer's state tensors read once and written once (each
    sub-group's region rounded up to the 4 KiB I/O block, not counted here).
    """
    reductions = 1 if keeps_full_gradients(stage) else accumulation_steps
    moved = {"device_to_host": reductions * partition * grad_bytes, "host_to_device": partition * param_bytes}
    if state_tensors:
        pages = (1 + state_tensors) * 4 * partition
        moved.update(nvme_read=pages, nvme_write=pages)
    return moved


def zenflow_selected_elements(shapes: list[tuple[int, ...]], topk_ratio: float) -> int:
    """Elements ZenFlow updates on the device every step: of each 2-D weight (rows, columns)
    its max(1, ⌊columns·ρ⌋) selected columns, and every 1-D parameter whole."""
    total = 0
    for shape in shapes:
        if len(shape) == 2:
            rows, columns = shape
            total += rows * (max(1, int(columns * topk_ratio)) if columns else 0)
        else:
            total += math.prod(shape)
    return total


def zenflow_transfer_bytes(partition: int, selected: int, *, steps: int, updates: int, selective_steps: int,
                           grad_bytes: int, param_bytes: int) -> dict[str, int]:
    """Bytes one rank moves between device and host over `steps` ZenFlow steps (C30), for a
    partition of Ψ/N elements of which `selected` are the rank's share of the selected
    columns (`zenflow_selected_elements`; all of them at N = 1).

    device -> host: each step's reduced gradient partition, as plain offload;
    host -> device: the selected gradients in fp32 at each of `selective_steps` steps, and
    the updated parameters only at the `updates` CPU updates (every update_interval U
    steps), where plain offload sends them every step. Per step, with ρ' = selected/Ψ:
    4ρ'Ψ/N + pΨ/(N·U) instead of pΨ/N.
    """
    return {"device_to_host": steps * partition * grad_bytes,
            "host_to_device": selective_steps * selected * 4 + updates * partition * param_bytes}


# -- tensor and sequence parallelism -------------------------------------------------------
#
# Bytes one rank sends per micro-batch (forward + backward) in the tensor or sequence
# group, exactly as shardwise's layers issue them. X = b·s·h·a: one full-sequence
# activation of b sequences of s tokens, width h, a bytes per element; L decoder layers;
# T the tensor group, S the sequence group. ring(Y) = Y(n−1)/n per rank for an
# all-gather / reduce-scatter / all-to-all of Y bytes, 2·ring(Y) for an all-reduce.
#
#   tensor group, Megatron TP   all-reduce  (2 + 4L)·2·ring(X): the embedding's sum and the
#                                           head's input gradient, and per layer the two
#                                           outputs summed in forward and the two inputs'
#                                           gradients summed in backward
#                               all-gather  ring(2·4·b·s·T): the loss's logsumexp and target
#                                           logit per token (the logits are never gathered)
#   + Megatron SP               the layers' all-reduces become all-gather + reduce-scatter
#                               of the same X: all-gather (1 + 6L + 1)·ring(X) (the split's
#                               backward; per layer the 2 regions' inputs gathered in forward,
#                               gathered again in backward for the column-parallel weight
#                               gradients, which keep only the shard (Megatron's recompute of
#                               the gather), and the row outputs' gradients gathered; the join
#                               after the stack), reduce-scatter 4L·ring(X), all-reduce
#                               2·2·ring(X) + Σ 2·ring(bytes) of each replicated layer
#                               parameter's gradient
#   sequence group, Ulysses     all-to-all  per layer 2·(2·ring(X/S) + 2·ring(X_kv/S)): q, k, v
#                                           and the output, forward and backward; X_kv is X
#                                           scaled by KV heads / heads (KV heads repeated to S
#                                           when fewer than S)
#                               all-gather  ring(X): the sequence made whole after the stack
#   Ulysses S with tensor T     the tensor group's per-layer collectives carry 1/S of the
#                               positions: (2 + 4L) all-reduces become 2·2·ring(X) + 4L·2·ring(X/S)
#                               (embedding and head input stay whole); the sequence group's
#                               all-to-alls carry the h/T features and heads/T (KV heads/T,
#                               at least 1) each tensor rank holds; its all-gather stays ring(X)


@dataclass(frozen=True)
class ParallelCommShape:
    layers: int  # L
    micro_batch: int  # b
    seq_len: int  # s, the whole sequence
    hidden: int  # h
    activation_bytes: int  # a
    tensor_size: int = 1  # T
    sequence_size: int = 1  # S (Ulysses)
    megatron_sp: bool = False
    heads: int = 1
    kv_heads: int = 1
    replicated_layer_param_bytes: tuple[int, ...] = ()  # Megatron SP: each such parameter's bytes (gradient)
    accumulation_steps: int = 1  # A: every collective here runs every micro-batch


def _ring(op: str, nbytes: int, ranks: int) -> int:
    share = nbytes * (ranks - 1) // ranks
    return 2 * share if op == "all_reduce" else share


def tensor_parallel_comm_bytes(shape: ParallelCommShape) -> dict[str, int]:
    """Bytes per step in the tensor group (see the notes above)."""
    t, layers = shape.tensor_size, shape.layers
    x = shape.micro_batch * shape.seq_len * shape.hidden * shape.activation_bytes
    volume = dict.fromkeys(COLLECTIVES, 0)
    if t == 1:
        return volume
    loss = _ring("all_gather", 2 * 4 * shape.micro_batch * shape.seq_len * t, t)
    if shape.sequence_size > 1:  # Ulysses inside the layers: 1/S of the positions per tensor collective
        volume["all_reduce"] = 2 * _ring("all_reduce", x, t) + 4 * layers * _ring(
            "all_reduce", x // shape.sequence_size, t)
        volume["all_gather"] = loss
    elif shape.megatron_sp:
        volume["all_gather"] = (2 + 6 * layers) * _ring("all_gather", x, t) + loss
        volume["reduce_scatter"] = 4 * layers * _ring("reduce_scatter", x, t)
        volume["all_reduce"] = 2 * _ring("all_reduce", x, t) + sum(
            _ring("all_reduce", nbytes, t) for nbytes in shape.replicated_layer_param_bytes)
    else:
        volume["all_reduce"] = (2 + 4 * layers) * _ring("all_reduce", x, t)
        volume["all_gather"] = loss
    return {op: nbytes * shape.accumulation_steps for op, nbytes in volume.items()}


def ulysses_comm_bytes(shape: ParallelCommShape) -> dict[str, int]:
    """Bytes per step in the sequence group (Ulysses; see the notes above)."""
    s = shape.sequence_size
    volume = {"all_to_all": 0, "all_gather": 0}
    if s == 1:
        return volume
    x = shape.micro_batch * shape.seq_len * shape.hidden * shape.activation_bytes
    t = shape.tensor_size  # each tensor rank exchanges its own h/T features and heads/T heads
    heads, kv_heads = shape.heads // t, max(shape.kv_heads // t, 1)
    kv_heads = kv_heads if kv_heads % s == 0 else s
    local = x // t // s
    local_kv = local * kv_heads // heads
    per_layer = 2 * (2 * _ring("all_to_all", local, s) + 2 * _ring("all_to_all", local_kv, s))
    volume["all_to_all"] = shape.layers * per_layer * shape.accumulation_steps
    volume["all_gather"] = _ring("all_gather", x, s) * shape.accumulation_steps
    return volume


# Pipeline parallelism, bytes one rank sends per optimizer step over the pipeline group
# (point to point, counted under ("pipeline", "send")). p stages, v chunks per rank (v = 1
# except interleaved), m micro-batches, X = b·s·h·a the hidden states of one micro-batch:
#
#   activations  X to the next virtual stage, per micro-batch, from every chunk but the
#                model's last:           m·X·(v − [rank = p−1])
#   gradients    X to the previous one, from every chunk but the model's first:
#                                        m·X·(v − [rank = 0])
#   tied weight  an embedding tied to the output layer: the first stage sends its
#                weight (W bytes) to the last, which sends its gradient (W) back
#
# Summed over the p ranks: 2·m·X·(p·v − 1) + 2W per step.


@dataclass(frozen=True)
class PipelineCommShape:
    micro_batch: int  # b
    seq_len: int  # s
    hidden: int  # h
    activation_bytes: int  # a
    size: int  # p
    micro_batches: int  # m
    virtual: int = 1  # v
    tied_weight_bytes: int = 0  # W (0 when the embedding is not tied)


def pipeline_p2p_bytes(shape: PipelineCommShape, rank: int) -> int:
    """Bytes pipeline rank `rank` sends per step (see the notes above)."""
    p = shape.size
    if p == 1:
        return 0
    x = shape.micro_batch * shape.seq_len * shape.hidden * shape.activation_bytes
    forward = shape.micro_batches * x * (shape.virtual - (rank == p - 1))
    backward = shape.micro_batches * x * (shape.virtual - (rank == 0))
    tied = shape.tied_weight_bytes if rank in (0, p - 1) else 0
    return forward + backward + tied


def pipeline_p2p_total_bytes(shape: PipelineCommShape) -> int:
    """Bytes all pipeline ranks send per step: 2·m·X·(p·v − 1) + 2W."""
    return sum(pipeline_p2p_bytes(shape, rank) for rank in range(shape.size))


# -- 1-bit Adam / 1-bit LAMB (C18) ----------------------------------------------------------
# After the warm-up the exchange group (stage 0: the replicate group; stages 1-2: the shard
# group, N ranks) exchanges the momentum instead of reducing gradients, in two collectives
# per step, L elements cut into N chunks of L/N, each sent as sign bits and one fp32 scale:
#
#     all-to-all   (L/8 + 4N)(N−1)/N     each rank's N chunks to their servers
#     all-gather   (L/8 + 4N)(N−1)/N     each server's averaged chunk to every rank
#
# Stage 0: L = Ψ rounded up to a multiple of 8N. Stages 1-2: chunk r is rank r's ZeRO
# partition, Ψ/N (Ψ padded as the units pad it) rounded up to whole bytes, L = N·that;
# and ZeRO's all-gather of the updated parameters follows, Ψp(N−1)/N. Against 2·4Ψ(N−1)/N
# for an fp32 all-reduce, the momentum costs 1/32 of it, plus 8(N−1) bytes of scales.
# The first compressed step at stages 1-2 (and the first after a load) also all-gathers
# the momentum partitions once in fp32, 4Ψ(N−1)/N: until then the momentum is partitioned.
def onebit_exchange_bytes(num_params: int, ranks: int, stage: int = 0, param_bytes: int = 0) -> dict[str, int]:
    """Bytes one rank sends per compressed step of `num_params` elements (stages 1-2: the
    units' padded total, a multiple of `ranks`) with `param_bytes`-byte parameters."""
    volume = {"all_to_all": 0, "all_gather": 0}
    if ranks == 1:
        return volume
    if not partitions_optimizer(stage):  # stage 0: no ZeRO partition for the chunks to follow
        padded = (num_params + 8 * ranks - 1) // (8 * ranks) * 8 * ranks
    else:
        padded = ranks * ((num_params // ranks + 7) // 8 * 8)
    framed = padded // 8 + 4 * ranks  # every chunk's packed signs and its fp32 scale
    volume["all_to_all"] = _ring("all_to_all", framed, ranks)
    volume["all_gather"] = _ring("all_gather", framed, ranks)
    if gathers_updated_parameters(stage):
        volume["all_gather"] += ring_share(num_params, param_bytes, ranks)
    return volume


# -- 0/1 Adam (C18) -------------------------------------------------------------------------
# DeepSpeed's ZeroOneAdam (Lu et al., 2022) at stage 0 over N data-parallel ranks: what a
# step sends depends on its place in the schedule, which is counters only (the optimizer's
# own state machine, runtime/optim/zero_one_adam.py, is checked against this one):
#
#     step 1              nothing: the step only sets the optimizer up, as DeepSpeed's
#     variance steps      the engine's fp32 gradient all-reduce, 2·gΨ(N−1)/N: steps t
#                         (2 ≤ t ≤ var_freeze_step + 1) with t % interval = 0; the interval
#                         starts at 1 and doubles after every var_update_scaler of them
#     other steps to then the local gradient through the 1-bit exchange (onebit_exchange_bytes)
#     later steps         local: nothing; or, at t % local_interval = 0, the accumulated
#                         update through the 1-bit exchange. local_interval starts at 1 and
#                         doubles (up to local_step_clipper) after every local_step_scaler steps
ZERO_ONE_ADAM_STEP_KINDS = ("setup", "variance", "onebit_gradient", "local", "sync")


def zero_one_adam_step_kinds(steps: int, *, var_freeze_step: int, var_update_scaler: int = 16,
                             local_step_scaler: int = 32678, local_step_clipper: int = 16) -> list[str]:
    """What each of steps 1..`steps` exchanges (ZERO_ONE_ADAM_STEP_KINDS), by the schedule above."""
    kinds, var_interval, var_counter, local_interval, local_counter = [], 1, 0, 1, 0
    for step in range(1, steps + 1):
        if step == 1:
            kinds.append("setup")
        elif step <= var_freeze_step + 1:
            variance = step % var_interval == 0
            kinds.append("variance" if variance else "onebit_gradient")
            if variance:
                var_counter += 1
                if var_counter == var_update_scaler:
                    var_counter, var_interval = 0, var_interval * 2
        else:
            kinds.append("sync" if step % local_interval == 0 else "local")
            local_counter += 1
            if local_counter == local_step_scaler:
                local_counter, local_interval = 0, min(local_step_clipper, local_interval * 2)
    return kinds


def zero_one_adam_step_bytes(kind: str, num_params: int, ranks: int, grad_bytes: int = 4) -> dict[str, int]:
    """Bytes one rank sends in a step of `kind` (`zero_one_adam_step_kinds`) with `num_params`
    parameters over `ranks` data-parallel ranks, gradients of `grad_bytes` bytes."""
    volume = {"all_reduce": 0, "all_to_all": 0, "all_gather": 0}
    if kind not in ZERO_ONE_ADAM_STEP_KINDS:
        raise ValueError(f"step kind {kind!r} is not one of {', '.join(ZERO_ONE_ADAM_STEP_KINDS)}")
    if kind == "variance":
        volume["all_reduce"] = _ring("all_reduce", num_params * grad_bytes, ranks)
    elif kind in ("onebit_gradient", "sync"):
        volume.update(onebit_exchange_bytes(num_params, ranks))
    return volume


# -- recomputation under ZeRO-3 (C9) -------------------------------------------------------
# A checkpointed layer re-runs its forward in backward, and ZeRO-3 gathers its units for
# that recomputation; they are then kept for the layer's backward, which would otherwise
# gather them itself. So the recomputation moves the backward half of stage 3's
# 2(Ψ−P)p(S−1)/S forward it and adds nothing: per micro-batch, for the ℓ layers it re-runs,
# ℓ·Ψ_layer·p(S−1)/S of the all-gather term above happen in recomputations.
def recompute_gather_bytes(layer_params: int, recomputed_layers: int, param_bytes: int, shard_size: int) -> int:
    """Bytes one rank sends in the gathers of `recomputed_layers` layer recomputations of
    `layer_params` parameters each: part of the stage-3 all-gather term, not extra."""
    return recomputed_layers * ring_share(layer_params, param_bytes, shard_size)


# -- generation from a ZeRO-3 policy (C32: TRL's GRPO) -------------------------------------
# Generation runs one forward per new token. Gathered once for the whole `generate` call
# (`gathered_for_generation`, TRL's ds3_gather_for_generation), it costs one all-gather of
# the partitioned parameters, (Ψ−P)p(S−1)/S, whatever the completion length; gathered by
# each forward's hooks it would cost that per new token.
def generation_gather_bytes(num_params: int, *, persistent_params: int, param_bytes: int, shard_size: int,
                            gathers: int) -> int:
    """Bytes one rank sends in `gathers` all-gathers of the stage-3 policy (Ψ = `num_params`
    padded, P = `persistent_params` kept whole): 1 for a generation gathered once, one per
    new token without that gather."""
    return gathers * ring_share(num_params - persistent_params, param_bytes, shard_size)


# -- ZeRO++ (C28) ---------------------------------------------------------------------------
# Stage 3 over a shard group of N = n·L ranks, n nodes of L (ranks r·L .. r·L+L−1 on node r),
# per rank per optimizer step, for each partitioned unit u of P_u padded elements (Ψ = Σ P_u,
# every parameter partitioned: P = 0, each used once per forward), chunk C_u = P_u/N, over A
# micro-batches. A frame of m elements quantized to `bits` with one fp32 scale per block of
# B elements is F(m) = ⌈m/8⌉·bits + 4⌈m/B⌉ bytes (runtime/distributed/quantized.py).
#
#   shard all-gather        plain: 2A·Σ P_u·p(N−1)/N (forward and backward);
#                           qwZ: each gather sends int8 frames, Σ F₈(C_u)·(N−1);
#                           hpZ: only the step's first gather reads the primary shards (once
#                           per step, not 2A times): every later one, until the update,
#                           reads the secondary partition inside the node
#   secondary all-gather    hpZ: (2A − 1)·Σ P_u·p(H−1)/H inside the node (unquantized)
#   shard reduce-scatter    A·Σ P_u·g(N−1)/N, unless qgZ replaces it by
#   shard_node all-to-all   qgZ: A·Σ F₄(n·C_u)·(L−1)   (the n chunks each node-mate owns)
#   shard_nodes all-to-all  qgZ: A·Σ F₄(C_u)·(n−1)     (the node's partial sums, across)
#
# Bytes between nodes, per node (what leaves one node; docs/formulas.md#zero-bytes-between-nodes):
# a ring over the shard group crosses each node boundary once, so a node sends one rank's
# share of the shard group's all-gathers and reduce-scatters; hpZ's gathers and qgZ's first
# hop stay inside it; each of its L ranks sends its whole second hop across. In the paper's
# units (M = 2Ψ, 16-bit): 3M per step for ZeRO-3 → about 0.5M (qwZ) + 0 (hpZ) + 0.25M (qgZ),
# the "4×" in the limit of many nodes; `zero_plus_plus_ratio` evaluates it at any size.


@dataclass(frozen=True)
class ZeroPlusPlusShape:
    units: tuple[int, ...]  # P_u: padded elements of each partitioned unit
    shard_size: int  # N
    ranks_per_node: int  # L: the shard group's ranks on one node (N = n·L)
    param_bytes: int  # p
    grad_bytes: int  # g
    quantized_weights: bool = False  # qwZ
    hpz_partition_size: int = 1  # H (1: off)
    quantized_gradients: bool = False  # qgZ
    weight_block: int = 2048
    gradient_block: int = 512
    accumulation_steps: int = 1  # A

    @property
    def nodes(self) -> int:
        return self.shard_size // self.ranks_per_node


def quantized_frame_bytes(numel: int, *, block: int, bits: int) -> int:
    """F(m): `numel` codes of `bits` bits padded to a multiple of 8 elements, and one fp32
    scale per block (runtime/distributed/quantized.py frames them so)."""
    return -(-numel // 8) * 8 * bits // 8 + 4 * -(-numel // block)


def zero_plus_plus_bytes_by_group(shape: ZeroPlusPlusShape) -> dict[str, dict[str, int]]:
    """Bytes one rank sends per step in each group ZeRO-3 with ZeRO++ uses (see above)."""
    n_ranks, local, nodes, a = shape.shard_size, shape.ranks_per_node, shape.nodes, shape.accumulation_steps
    p, g, hpz = shape.param_bytes, shape.grad_bytes, shape.hpz_partition_size
    if n_ranks % local or (hpz > 1 and local % hpz):
        raise ValueError(f"{local} ranks per node must divide the shard group's {n_ranks}, and hpZ's {hpz} divide "
                         f"the {local}")
    one_gather = sum(
        quantized_frame_bytes(units // n_ranks, block=shape.weight_block, bits=8) * (n_ranks - 1)
        if shape.quantized_weights else ring_share(units, p, n_ranks) for units in shape.units)
    primary_gathers = 1 if hpz > 1 else 2 * a
    volume = {"shard": {"all_gather": primary_gathers * one_gather, "reduce_scatter": 0}}
    if hpz > 1:
        volume["secondary"] = {"all_gather": (2 * a - 1) * sum(ring_share(units, p, hpz) for units in shape.units)}
    if shape.quantized_gradients:
        block = shape.gradient_block
        volume["shard_node"] = {"all_to_all": a * sum(
            quantized_frame_bytes(nodes * (units // n_ranks), block=block, bits=4) * (local - 1)
            for units in shape.units)}
        volume["shard_nodes"] = {"all_to_all": a * sum(
            quantized_frame_bytes(units // n_ranks, block=block, bits=4) * (nodes - 1) for units in shape.units)}
    else:
        volume["shard"]["reduce_scatter"] = a * sum(ring_share(units, g, n_ranks) for units in shape.units)
    return volume


def inter_node_bytes_per_node(shape: ZeroPlusPlusShape) -> int:
    """Bytes one node sends to other nodes per step (see above); 0 on one node."""
    if shape.nodes == 1:
        return 0
    volume = zero_plus_plus_bytes_by_group(shape)
    across = volume.get("shard_nodes", {}).get("all_to_all", 0)
    return sum(volume["shard"].values()) + shape.ranks_per_node * across


def zero_plus_plus_ratio(num_params: int, *, shard_size: int, ranks_per_node: int, weight_block: int = 2048,
                         gradient_block: int = 512) -> float:
    """Bytes between nodes per step of 16-bit ZeRO-3 over those of ZeRO++ (qwZ + hpZ over
    the node + qgZ), for Ψ = `num_params` in one unit: the paper's 4× as the node count grows."""
    units = (num_params,)
    plain = ZeroPlusPlusShape(units, shard_size, ranks_per_node, param_bytes=2, grad_bytes=2)
    plus = ZeroPlusPlusShape(units, shard_size, ranks_per_node, param_bytes=2, grad_bytes=2, quantized_weights=True,
                             hpz_partition_size=ranks_per_node, quantized_gradients=True,
                             weight_block=weight_block, gradient_block=gradient_block)
    return inter_node_bytes_per_node(plain) / inter_node_bytes_per_node(plus)


def moe_all_to_all_bytes(*, experts: int, capacity: int, width: int, bytes_per_element: int, ep_size: int,
                         layers: int = 1, backward: bool = True) -> int:
    """Bytes one rank sends in the all-to-alls of expert parallelism (docs/formulas.md#expert-parallelism):
    per MoE layer its (experts, capacity, width) buffer goes to the experts and comes back
    (two all-to-alls forward, two more for their gradients in backward), each sending the
    (P-1)/P of the buffer bound for the other members of the expert group of P ranks."""
    exchanges = 4 if backward else 2
    return layers * exchanges * _ring("all_to_all", experts * capacity * width * bytes_per_element, ep_size)


def expert_gradient_bytes(*, bucket_numels: Sequence[int], expert_data_size: int, stage: int,
                          param_bytes: int) -> dict[str, int]:
    """Bytes one rank sends per optimizer step for its experts' gradients and update under
    expert parallelism (docs/formulas.md#expert-parallelism), over the expert-data group
    of N ranks holding the same experts. The gradients travel in fp32 (4 bytes), once
    per step (they accumulate whole over the micro-batches): at stage 0 each bucket of G
    elements is all-reduced, 2·4G(N−1)/N; at stages 1-3 the bucket padded to N·⌈G/N⌉ is
    reduce-scattered, 4·N⌈G/N⌉(N−1)/N, and the updated slices all-gathered in the
    parameters' `param_bytes` p, p·N⌈G/N⌉(N−1)/N."""
    volume = dict.fromkeys(COLLECTIVES, 0)
    n = expert_data_size
    for numel in bucket_numels:
        if not partitions_optimizer(stage):
            volume["all_reduce"] += _ring("all_reduce", 4 * numel, n)
            continue
        padded = -(-numel // n) * n
        volume["reduce_scatter"] += _ring("reduce_scatter", 4 * padded, n)
        volume["all_gather"] += _ring("all_gather", param_bytes * padded, n)
    return volume


MOE_COUNT_BYTES = 8  # int64 per-expert counts of the dropless exchange


def dropless_exchange_bytes(routed: Sequence[Sequence[int]], *, member: int, hidden_size: int,
                            bytes_per_element: int, backward: bool = True) -> int:
    """Bytes member `member` sends for one layer call of the dropless expert exchange
    (docs/formulas.md#expert-parallelism): Mixtral's routing keeps every token, so what a
    rank sends depends on where the tokens went. Over an expert group of P ranks and E
    experts (E/P per member), `routed[q][e]` (token, choice) pairs of member q chose expert
    e. Member m sends:

        counts     8·(E/P)·(P−1)                        its per-expert counts (int64)
        dispatch   h·b·Σ_{e not m's} routed[m][e]       its rows bound for others' experts
        combine    h·b·Σ_{q≠m} Σ_{e m's} routed[q][e]   the outputs of the rows it received

    and in backward each exchange's gradient goes the other way (the combine's as many rows
    as the dispatch sent, the dispatch's as many as the combine sent): h hidden size, b
    bytes per element. Rows a member routes to its own experts never leave it."""
    ranks, experts = len(routed), len(routed[0])
    if experts % ranks:
        raise ValueError(f"{experts} experts do not split over {ranks} ranks")
    local = experts // ranks
    sent = sum(count for expert, count in enumerate(routed[member]) if expert // local != member)
    received = sum(routed[other][expert] for other in range(ranks) if other != member
                   for expert in range(member * local, (member + 1) * local))
    rows = (sent + received) * (2 if backward else 1)
    return MOE_COUNT_BYTES * local * (ranks - 1) + rows * hidden_size * bytes_per_element
