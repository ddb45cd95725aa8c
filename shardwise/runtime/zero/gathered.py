"""`shardwise.gathered_parameters`: full weights outside forward and backward (C4, C24).

In stage 3 a parameter outside its module's forward is an empty placeholder. Code that
reads weights elsewhere (exporting, logging norms, a loss term on a weight, custom
initialisation) wraps that code in this context: the units holding the parameters are
gathered on entry and released on exit. It is a collective: every rank must enter it
with the same parameters. At stage 3 the ranks first agree that they all entered it (the
gather-order check, gather_schedule.py, waiting at most a fifth of the collective
timeout): a rank that entered it alone would otherwise pair its gathers with another
rank's forward, which aborts the process inside gloo or waits out the timeout.

With `modifier_rank=r`, edits made on rank r inside the block are broadcast on exit and
written into every rank's shard and fp32 master copy, so training continues from them.
Stages 0-2 keep full weights already; there the context only does that write-back.

The gathered memory is released on exit: keep values beyond the block by copying them
(`p.detach().clone()`), not through views or `p.detach()`, which share that memory.

`gathered_for_generation(params)` gathers the same way, once, and within it the stage-3
forward hooks stand aside: generation runs one forward per new token, and each rank runs
as many as its own sequences need, with no collective (gather_schedule.py explains why one
per forward cannot work there). DeepSpeed's `GatheredParameters` around `generate`, as
TRL uses it, does the same with its hooks removed.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Iterable, Iterator

import torch
from torch import nn

from shardwise.runtime.distributed.setup import call_check_timeout, collective_timeout
from shardwise.runtime.zero.apply import ZeroState


def zero_of(param: torch.Tensor) -> ZeroState | None:
    """The ZeRO state of the live engine that holds `param` (set when the engine takes
    over the parameters, removed by `engine.destroy()`), or None."""
    reference = getattr(param, "_shardwise_zero", None)
    return reference() if reference is not None else None


@contextmanager
def gathered_parameters(
    params: nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None
) -> Iterator[None]:
    params = [params] if isinstance(params, nn.Parameter) else list(params)
    by_engine: dict[int, tuple[ZeroState, list[nn.Parameter]]] = {}
    for param in params:  # several engines (a GAN's two models): one after the other, in first-seen order
        zero = zero_of(param)
        if zero is None:
            raise ValueError("gathered_parameters() got a parameter that no shardwise engine trains")
        by_engine.setdefault(id(zero), (zero, []))[1].append(param)
    with ExitStack() as stack:
        for zero, owned in by_engine.values():
            stack.enter_context(_gathered_of_engine(zero, owned, modifier_rank))
        yield


@contextmanager
def _gathered_of_engine(zero: ZeroState, params: list[nn.Parameter], modifier_rank: int | None) -> Iterator[None]:
    held = [zero.unit_of_param[id(p)] for p in params if id(p) in zero.unit_of_param]
    units = sorted({id(u): u for u in held}.values(), key=lambda unit: unit.index)  # the same order on every rank
    whole = [p for p in params if id(p) not in zero.unit_of_param]  # frozen, held whole on every rank
    strategy = zero.params
    if units and zero.policy.partitions_parameters:
        strategy.schedule.agree_on_entering("gathered_parameters", call_check_timeout(collective_timeout()))
    strategy.acquire(units)
    try:
        yield
    finally:
        if modifier_rank is not None:
            source = _group_rank(zero.groups.replicas.handle.ranks, modifier_rank)
            for param in whole:
                zero.groups.replicas.broadcast(param.data, source, "edited frozen parameter")
            trained = {id(unit) for unit in zero.units} if zero.store is not None else set()
            for unit in units:
                strategy.broadcast_edits(unit, source)
                if id(unit) in trained:  # frozen units (and a forward-only engine's) have no master
                    zero.store.refresh_master(unit)
        strategy.release(units)


@contextmanager
def gathered_for_generation(params: Iterable[nn.Parameter]) -> Iterator[None]:
    """`gathered_parameters(params)` (one all-gather of each unit, on every rank at the
    same point), inside which the model's forwards read the gathered units and communicate
    nothing: any number per rank, without gradients. Pass every parameter of the model."""
    params = list(params)
    engines = {id(zero): zero for param in params if (zero := zero_of(param)) is not None}
    with gathered_parameters(params), ExitStack() as stack:
        for zero in engines.values():
            if zero.policy.partitions_parameters:
                stack.enter_context(zero.params.schedule.standing_aside())
        yield


def _group_rank(members: tuple[int, ...], modifier_rank: int) -> int:
    """`modifier_rank` is a global rank, as in DeepSpeed; broadcasts name group ranks."""
    if modifier_rank not in members:
        raise ValueError(f"modifier_rank {modifier_rank} does not hold these parameters; the ranks "
                         f"that do are {list(members)}")
    return members.index(modifier_rank)
