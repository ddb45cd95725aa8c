"""The whole-model momentum of 1-bit Adam / 1-bit LAMB under ZeRO stages 1-2 (C18).

After the warm-up every worker folds its own gradient into the momentum of *every*
element, m_i = β1·m + (1 − β1)·g_i, because its compressed contribution to the average
covers the whole model; so the momentum is whole on every rank (and so is the worker's
error buffer). Everything else stays partitioned as ZeRO-1/2 partitions it: the fp32
masters, the frozen variance, 1-bit LAMB's per-parameter state, and the server's error.

The layout makes the compressed all-reduce's server chunks the ZeRO partitions: the
momentum is a matrix of N rows, row r = rank r's partition (its chunk of every unit,
in unit order, padded to whole bytes of signs), and chunk j of the exchange is row j.
Rank j therefore averages, compresses and error-corrects exactly the momentum of the
elements whose masters it updates; each optimizer state's `exp_avg` is a view of the
rank's own row, and after the exchange's all-gather every row holds the averaged
momentum, as every worker's next fold needs.

The local gradients arrive per unit in the unit's own layout (its N chunks back to back),
so folding one unit is one strided operation: the unit's chunks, viewed as N rows, onto
the unit's N column ranges of the matrix (on CPU, fp32: the native kernels' one-pass
`momentum_fold`, a row at a time, the torch path's arithmetic bit for bit).
"""

from __future__ import annotations

from typing import Callable

import torch

from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.distributed.compressed import BITS
from shardwise.runtime.optim import native
from shardwise.runtime.zero.layout import FlatUnit
from shardwise.runtime.zero.shard_store import SegmentState


class PartitionedMomentum:
    """Where each element of the whole momentum sits; folds local gradients into it."""

    def __init__(self, units: list[FlatUnit], communicator: Communicator, segments: list[SegmentState],
                 local_gradient: Callable[[FlatUnit], torch.Tensor]):
        self.units = units
        self.communicator = communicator
        self.ranks, self.rank = communicator.size, communicator.rank
        self.local_gradient = local_gradient
        self._column = {}
        offset = 0
        for unit in units:
            self._column[unit.index] = offset
            offset += unit.chunk_numel
        self.partition = -(-offset // BITS) * BITS  # whole bytes of signs per server chunk
        self.numel = self.ranks * self.partition
        self._own = {id(s.master): (self._column[s.unit] + s.start, self._column[s.unit] + s.stop) for s in segments}
        self._pairs: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self._pairs_for = -1

    def allocate(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.numel, dtype=torch.float32, device=device)

    def own_row(self, momentum: torch.Tensor) -> torch.Tensor:
        """This rank's partition of the flat momentum (the chunk it serves)."""
        return momentum[self.rank * self.partition : (self.rank + 1) * self.partition]

    def own_view(self, momentum: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        """The momentum of the master segment `master`, a view of this rank's row."""
        lo, hi = self._own[id(master)]
        return self.own_row(momentum)[lo:hi].view_as(master)

    def gather_rows_(self, momentum: torch.Tensor) -> None:
        """Every rank's row from its owner, uncompressed: the momentum becomes whole (once,
        when the warm-up ends or after a load, since until then it is partitioned)."""
        self.communicator.all_gather(momentum, self.own_row(momentum).clone(),
                                     "1-bit momentum partitions (whole momentum, once)").wait()

    def fold_(self, momentum: torch.Tensor, beta1_of_group: Callable[[int], float], scale: float) -> None:
        """m <- β1·m + (1 − β1)·scale·g over every element, g the window's local gradient;
        `scale` is the step's clip coefficient over the loss scale. The gradient buffers are
        scaled in place (the window's gradients are spent by this step)."""
        kernels = native.library() if native.enabled() else None
        for target, gradient, group in self._fold_pairs(momentum):
            if gradient.dtype != torch.float32:
                gradient = gradient.float()
            if scale != 1.0:
                gradient.mul_(scale)
            beta1 = beta1_of_group(group)
            rows, gradients = target.view(-1, target.shape[-1]), gradient.view(-1, target.shape[-1])
            if kernels is not None and native.takes(gradients) and rows.device.type == "cpu" and rows.stride(-1) == 1:
                for row, row_gradient in zip(rows, gradients):  # one pass per row (optim/native.py)
                    kernels.momentum_fold(row.data_ptr(), row_gradient.data_ptr(), row.numel(), beta1, 1 - beta1)
                continue
            target.mul_(beta1).add_(gradient, alpha=1 - beta1)

    def local_norm_squared(self) -> torch.Tensor:
        """This rank's share of the clipping norm²: its whole local gradient's squared norm
        (fp32 per unit, as the reduced partitions are summed) over N, in float64, so the
        step check's sum over ranks is the mean of the ranks' local norms² (optim/onebit.py)."""
        norms = [torch.linalg.vector_norm(self.local_gradient(unit), dtype=torch.float32) for unit in self.units]
        return torch.stack(norms).square().sum().double() / self.ranks

    def _fold_pairs(self, momentum: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """(momentum view, local gradient view, param group) covering every element: per
        unit, one N-row pair when one param group trains the whole unit, else one pair per
        run of a group within each chunk."""
        if self._pairs_for == momentum.data_ptr():
            return self._pairs
        matrix = momentum.view(self.ranks, self.partition)
        pairs = []
        for unit in self.units:
            gradient, column, width = self.local_gradient(unit), self._column[unit.index], unit.chunk_numel
            runs = _group_runs(unit)
            if len(runs) == 1:
                pairs.append((matrix[:, column : column + width], gradient.view(self.ranks, width), runs[0][0]))
                continue
            for group, lo, hi in runs:
                for rank in range(self.ranks):
                    start, stop = max(lo, rank * width), min(hi, (rank + 1) * width)
                    if start < stop:
                        local = slice(column + start - rank * width, column + stop - rank * width)
                        pairs.append((matrix[rank, local], gradient[start:stop], group))
        self._pairs, self._pairs_for = pairs, momentum.data_ptr()
        return pairs


def _group_runs(unit: FlatUnit) -> list[tuple[int, int, int]]:
    """(param group, start, stop) runs over the unit's padded buffer; padding joins the last."""
    runs: list[tuple[int, int, int]] = []
    for slot in unit.slots:
        if runs and runs[-1][0] == slot.group:
            runs[-1] = (slot.group, runs[-1][1], slot.offset + slot.numel)
        else:
            runs.append((slot.group, slot.offset, slot.offset + slot.numel))
    runs[-1] = (runs[-1][0], runs[-1][1], unit.padded_numel)
    return runs
