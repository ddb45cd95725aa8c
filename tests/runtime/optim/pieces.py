"""A shard group without processes: N optimizers in N threads, each over pieces of the same
parameters cut where the test says, summing through a barrier.

It isolates what a shard-aware optimizer does with pieces from everything else ZeRO
changes: the gradients here are exactly the single-process ones, so any difference from
the same optimizer on whole parameters is the optimizer's own (for an algorithm whose
whole-parameter statistics are computed exactly, none at all).
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable

import torch

from shardwise.runtime.optim.sharded import ParameterShard, ShardAwareOptimizer

MakeOptimizer = Callable[[list[torch.Tensor]], ShardAwareOptimizer]


class ThreadedShardGroup:
    """`sum_for(rank)` sums a tensor over all ranks, adding in rank order (so every rank
    gets the same bits)."""

    def __init__(self, size: int):
        self.size = size
        self._barrier = threading.Barrier(size, timeout=60)  # a rank that failed breaks it
        self._slots: list[torch.Tensor | None] = [None] * size

    def sum_for(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def reduce(tensor: torch.Tensor) -> torch.Tensor:
            self._slots[rank] = tensor.clone()
            self._barrier.wait()
            total = self._slots[0].clone()
            for other in self._slots[1:]:
                total += other
            self._barrier.wait()
            return tensor.copy_(total)

        return reduce


def cut(shapes: list[tuple[int, ...]], boundaries: list[int]) -> list[list[tuple[int, int, int]]]:
    """The parameters laid end to end and cut at `boundaries`: per rank, its pieces as
    (parameter index, start, stop) in the parameter's flattened coordinates."""
    edges = [0, *boundaries, sum(math.prod(shape) for shape in shapes)]
    ranks = []
    for low, high in zip(edges, edges[1:]):
        pieces, offset = [], 0
        for index, shape in enumerate(shapes):
            numel = math.prod(shape)
            start, stop = max(low, offset), min(high, offset + numel)
            if start < stop:
                pieces.append((index, start - offset, stop - offset))
            offset += numel
        ranks.append(pieces)
    return ranks


def train_in_pieces(make: MakeOptimizer, initial: list[torch.Tensor], grads: list[list[torch.Tensor]],
                    boundaries: list[int]) -> tuple[list[torch.Tensor], list[ShardAwareOptimizer]]:
    """Steps with the given per-step gradients, each rank training its pieces; returns the
    whole parameters reassembled, and each rank's optimizer."""
    shapes = [tuple(t.shape) for t in initial]
    layout = cut(shapes, boundaries)
    group = ThreadedShardGroup(len(layout))
    ranks = []
    for rank, pieces in enumerate(layout):
        tensors = [initial[index].reshape(-1)[start:stop].clone() for index, start, stop in pieces]
        optimizer = make(tensors)
        shards = {tensor: ParameterShard(f"p{index}", shapes[index], start, stop, index)
                  for tensor, (index, start, stop) in zip(tensors, pieces)}
        optimizer.attach_shards(shards, len(shapes), group.sum_for(rank), group.sum_for(rank))
        ranks.append((optimizer, tensors, pieces))
    for step_grads in grads:
        for _, tensors, pieces in ranks:
            for tensor, (index, start, stop) in zip(tensors, pieces):
                tensor.grad = step_grads[index].reshape(-1)[start:stop].clone()
        _run_in_threads([optimizer.step for optimizer, _, _ in ranks])
    whole = [torch.empty(shape) for shape in shapes]
    for _, tensors, pieces in ranks:
        for tensor, (index, start, stop) in zip(tensors, pieces):
            whole[index].view(-1)[start:stop] = tensor
    return whole, [optimizer for optimizer, _, _ in ranks]


def train_whole(make: Callable[[list[torch.Tensor]], Any], initial: list[torch.Tensor],
                grads: list[list[torch.Tensor]]) -> tuple[list[torch.Tensor], Any]:
    """The same steps on whole parameters, with `make(params)` (anything with `step()`):
    the parameters, and what `make` returned."""
    params = [t.clone() for t in initial]
    optimizer = make(params)
    for step_grads in grads:
        for param, grad in zip(params, step_grads):
            param.grad = grad.clone()
        optimizer.step()
    return params, optimizer


def _run_in_threads(calls: list[Callable[[], object]]) -> None:
    errors: list[BaseException] = []

    def run(call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as error:  # re-raised below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
