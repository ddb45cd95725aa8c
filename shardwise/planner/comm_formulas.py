"""Communication formulas: bytes one rank sends per optimizer step, per group (SPEC §4).

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

from dataclasses import dataclass

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
        shard["reduce_scatter"] = (1 if shape.stage <= 1 else a) * ring_share(psi, g, s)
        if shape.stage == 3:
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
    expressions["reduce_scatter"] = f"{per_micro if shape.stage >= 2 else ''}{g}Ψ{shard_ring}"
    gather = f"{p}Ψ{shard_ring}"
    if shape.stage == 3:
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
    reductions = 1 if stage <= 1 else accumulation_steps
    moved = {"device_to_host": reductions * partition * grad_bytes, "host_to_device": partition * param_bytes}
    if state_tensors:
        pages = (1 + state_tensors) * 4 * partition
        moved.update(nvme_read=pages, nvme_write=pages)
    return moved
