"""Pipeline schedules: the order in which one rank runs forward and backward passes.

A schedule is a plain list of `Action`s per rank, computed up front from (rank, pipeline
size p, micro-batches m, virtual stages v), so it can be read, tested without processes
(every schedule is checked to finish when receives block and sends do not) and executed
by one loop (runner.py), on steps common to every rank (`timeline`) whose messages
plan.py derives. Virtual stage s of the model lives on rank s % p as its chunk
s // p; with v = 1 chunk 0 is the rank's whole stage.

    GPipe        all m forwards, then all m backwards: holds m micro-batches' activations
    1F1B         p - r - 1 warm-up forwards, then one forward / one backward alternating,
                 then the remaining backwards: at most p - r micro-batches in flight
    interleaved  1F1B over v chunks per rank (Megatron's ordering): micro-batches go
                 through the chunks in groups of p, which shrinks the bubble from
                 (p-1)/(m+p-1) to (p-1)/(v*m+p-1) at v times the point-to-point traffic

All three run every micro-batch's backward on a rank in micro-batch order within a chunk,
so ZeRO's accumulation sees the same sequence of gradients as a plain loop would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Action:
    """One pass: `kind` "forward" or "backward" of `micro_batch` through this rank's
    `chunk` (virtual stage chunk * p + rank)."""

    kind: str
    chunk: int
    micro_batch: int


def schedule_actions(name: str, rank: int, size: int, micro_batches: int, virtual: int = 1) -> list[Action]:
    """The ordered passes rank `rank` of a `size`-stage pipeline runs for one batch."""
    if name == "gpipe":
        return _gpipe(micro_batches)
    if name == "1f1b":
        return _one_f_one_b(rank, size, micro_batches)
    if name == "interleaved":
        return _interleaved(rank, size, micro_batches, virtual)
    raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


def _gpipe(m: int) -> list[Action]:
    return [Action("forward", 0, i) for i in range(m)] + [Action("backward", 0, i) for i in range(m)]


def _one_f_one_b(rank: int, p: int, m: int) -> list[Action]:
    warmup = min(p - rank - 1, m)
    actions = [Action("forward", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        actions.append(Action("forward", 0, warmup + i))
        actions.append(Action("backward", 0, i))
    actions += [Action("backward", 0, i) for i in range(m - warmup, m)]
    return actions


def _interleaved(rank: int, p: int, m: int, v: int) -> list[Action]:
    """Megatron's interleaved order: the k-th forward of a rank is micro-batch
    (k // (p*v)) * p + k % p on chunk (k // p) % v; backwards walk the chunks in reverse."""
    if m % p:
        raise ValueError(f"the interleaved schedule needs micro-batches ({m}) divisible by the pipeline size ({p})")
    total = m * v

    def forward(k: int) -> Action:
        return Action("forward", (k // p) % v, (k // (p * v)) * p + k % p)

    def backward(k: int) -> Action:
        return Action("backward", v - 1 - (k // p) % v, (k // (p * v)) * p + k % p)

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    actions = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        actions.append(forward(warmup + k))
        actions.append(backward(k))
    actions += [backward(k) for k in range(total - warmup, total)]
    return actions


def timeline(queues: list[list[Action]], virtual: int) -> list[list[Action | None]]:
    """Every rank's passes placed on steps common to all ranks (None: idle), one pass per
    step, each as early as its inputs allow when every pass takes one step.

    A pass's messages travel in the exchange that ends its step, and a pass that needs a
    message runs at a later step, so executing step after step, each ending in one
    batched exchange between the ranks that have messages at that step, can neither
    deadlock nor pair the wrong messages (plan.py)."""
    starts, _, _ = _place(queues, virtual, lambda action: 1.0)
    length = 1 + max((int(start) for rank_starts in starts for start in rank_starts), default=-1)
    steps: list[list[Action | None]] = [[None] * length for _ in queues]
    for rank, (actions, rank_starts) in enumerate(zip(queues, starts)):
        for action, start in zip(actions, rank_starts):
            steps[rank][int(start)] = action
    return steps


def simulate(name: str, size: int, micro_batches: int, virtual: int = 1, forward_cost: float = 1.0,
             backward_cost: float = 2.0) -> dict[str, list[float]]:
    """Run every rank's actions against each other with blocking receives and free sends,
    at the given costs per pass of one chunk; returns each rank's finish time and busy time.

    Raises if the schedule deadlocks (some rank waits for a pass that never comes). Used by
    the tests to check the schedules and the bubble formulas without processes."""
    queues = [schedule_actions(name, rank, size, micro_batches, virtual) for rank in range(size)]
    _, finish, busy = _place(queues, virtual,
                             lambda action: forward_cost if action.kind == "forward" else backward_cost,
                             f"schedule {name}")
    return {"finish": finish, "busy": busy}


def _place(queues: list[list[Action]], virtual: int, cost: Callable[[Action], float],
           name: str = "the schedule") -> tuple[list[list[float]], list[float], list[float]]:
    """Start time of every rank's passes when each starts once its own previous pass and
    the passes it needs on other ranks have finished; with each rank's finish and busy time."""
    size = len(queues)
    position = [0] * size
    clock = [0.0] * size
    busy = [0.0] * size
    starts: list[list[float]] = [[] for _ in range(size)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro-batch) -> finish time
    last = size * virtual - 1
    while any(position[r] < len(queues[r]) for r in range(size)):
        progressed = False
        for rank in range(size):
            if position[rank] == len(queues[rank]):
                continue
            action = queues[rank][position[rank]]
            stage = action.chunk * size + rank
            if action.kind == "forward":
                needs = [("forward", stage - 1, action.micro_batch)] if stage > 0 else []
            else:
                needs = [("backward", stage + 1, action.micro_batch)] if stage < last else []
                needs.append(("forward", stage, action.micro_batch))
            if any(need not in done for need in needs):
                continue
            start = max([clock[rank]] + [done[need] for need in needs])
            starts[rank].append(start)
            clock[rank] = start + cost(action)
            busy[rank] += cost(action)
            done[(action.kind, stage, action.micro_batch)] = clock[rank]
            position[rank] += 1
            progressed = True
        if not progressed:
            stuck = {rank: queues[rank][position[rank]] for rank in range(size) if position[rank] < len(queues[rank])}
            micro_batches = 1 + max((a.micro_batch for actions in queues for a in actions), default=0)
            raise RuntimeError(f"{name} deadlocks at p={size} m={micro_batches} v={virtual}: waiting {stuck}")
    return starts, clock, busy
