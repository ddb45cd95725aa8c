"""The optimizer step on the slice of the model this rank owns (ZeRO-1/2/3, C2).

The user's torch optimizer (any class: its groups and hyper-parameters are kept) is
re-pointed from the model's parameters to fp32 *segments*: runs of this rank's chunk of
each unit that belong to one param group. Optimizer state is created lazily by torch,
so it only ever exists for the owned 1/N.

Mixed precision keeps a separate fp32 master copy of the owned chunks; fp32 training
updates the parameters' own chunks in place (no second copy, K = 8 instead of 12).

The step runs in sub-groups of about `sub_group_size` elements: torch skips parameters
whose `.grad` is None, so setting gradients for one sub-group at a time bounds the fp32
gradient copies that mixed precision needs by a constant instead of the model size.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch

from shardwise.accounting import MemoryLedger, tensor_bytes
from shardwise.zero.layout import FlatUnit


@dataclass(frozen=True)
class SegmentState:
    unit: int  # FlatUnit.index
    start: int  # [start, stop) inside this rank's chunk of the unit
    stop: int
    group: int
    master: torch.Tensor  # fp32, trained by the optimizer
    grad: torch.Tensor  # reduced gradient in the gradient dtype (a view, never copied here)


class ShardedOptimizer:
    def __init__(
        self,
        units: list[FlatUnit],
        chunk: int,
        param_chunks: list[torch.Tensor],
        grad_chunks: list[torch.Tensor],
        ledger: MemoryLedger,
        sub_group_size: int,
        make_optimizer: Callable[[list[list[torch.Tensor]]], torch.optim.Optimizer],
    ):
        """`make_optimizer` receives, per param group, the fp32 segments to train."""
        self.units = units
        self.param_chunks = param_chunks
        self.grad_chunks = grad_chunks
        self.ledger = ledger
        self.separate_master = param_chunks[0].dtype != torch.float32
        if self.separate_master:
            sizes = [piece.numel() for piece in param_chunks]
            self.master = torch.empty(sum(sizes), dtype=torch.float32, device=param_chunks[0].device)
            master_chunks = list(torch.split(self.master, sizes))
            for master_piece, param_piece in zip(master_chunks, param_chunks):
                master_piece.copy_(param_piece)
        else:
            self.master = None
            master_chunks = param_chunks
        self.master_chunks = master_chunks

        self.segments: list[SegmentState] = []
        for unit, master, grad in zip(units, master_chunks, grad_chunks):
            for segment in unit.segments(chunk):
                self.segments.append(
                    SegmentState(
                        unit.index,
                        segment.start,
                        segment.stop,
                        segment.group,
                        master[segment.start : segment.stop],
                        grad[segment.start : segment.stop],
                    )
                )
        self.optimizer = make_optimizer(self._segments_by_group())
        self.sub_groups = self._split_sub_groups(sub_group_size)
        self.record_state_bytes()

    def _segments_by_group(self) -> list[list[torch.Tensor]]:
        by_group: dict[int, list[torch.Tensor]] = defaultdict(list)
        for segment in self.segments:
            by_group[segment.group].append(segment.master)
        return [by_group.get(index, []) for index in range(max(by_group) + 1)]

    def _split_sub_groups(self, sub_group_size: int) -> list[list[SegmentState]]:
        groups: list[list[SegmentState]] = [[]]
        numel = 0
        for segment in self.segments:
            if groups[-1] and numel + segment.master.numel() > sub_group_size:
                groups.append([])
                numel = 0
            groups[-1].append(segment)
            numel += segment.master.numel()
        return groups

    # -- norms ---------------------------------------------------------------------------
    def local_grad_norm_squared(self) -> torch.Tensor:
        """Sum of squared owned gradients, accumulated in fp32 (fp16 squares overflow)."""
        norms = [torch.linalg.vector_norm(grad, dtype=torch.float32) for grad in self.grad_chunks]
        return torch.stack(norms).square().sum()

    # -- the update ------------------------------------------------------------------------
    def step(self, grad_scale: float) -> None:
        """Update owned parameters with gradients multiplied by `grad_scale`
        (loss-scale inverse times clip coefficient)."""
        for sub_group in self.sub_groups:
            copied = 0
            for segment in sub_group:
                grad = segment.grad
                if grad.dtype != torch.float32:
                    grad = grad.float()
                    copied += tensor_bytes(grad)
                if grad_scale != 1.0:
                    grad.mul_(grad_scale)
                segment.master.grad = grad
            self.ledger.hold("buffers", copied)
            self.optimizer.step()
            for segment in sub_group:
                segment.master.grad = None
            self.ledger.release("buffers", copied)
        if self.separate_master:
            for param_chunk, master_chunk in zip(self.param_chunks, self.master_chunks):
                param_chunk.copy_(master_chunk)
        self.record_state_bytes()

    def refresh_master(self, unit: FlatUnit) -> None:
        """Take the master copy of `unit` from its (edited) parameter chunk."""
        if self.separate_master:
            position = self.units.index(unit)
            self.master_chunks[position].copy_(self.param_chunks[position])

    def record_state_bytes(self) -> None:
        """Master copy plus per-element optimizer state (scalars such as `step` excluded)."""
        total = tensor_bytes(self.master) if self.master is not None else 0
        for segment in self.segments:
            for value in self.optimizer.state.get(segment.master, {}).values():
                if torch.is_tensor(value) and value.shape == segment.master.shape:
                    total += tensor_bytes(value)
        self.ledger.set("optimizer_states", total)
