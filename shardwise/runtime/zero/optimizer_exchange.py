"""The gradient reducer's side for an optimizer that exchanges gradients itself.

1-bit Adam / LAMB after their warm-up exchange compressed momentum instead of letting
backward reduce gradients: backward then only accumulates each rank's own gradients, in
the full buffers at stages 0-1 and, at stage 2, in a whole-model local buffer allocated
when that phase starts (the optimizer folds the window's whole local gradient into the
momentum at its step, once clipping and loss scaling are known). Mixed into
`GradientReducer` (gradients.py), whose state it uses.
"""

from __future__ import annotations

from typing import Callable

import torch

from shardwise.runtime.accounting import tensor_bytes
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.zero.layout import FlatUnit


class OptimizerExchangeMixin:
    def exchange_for_optimizer(self, who: str) -> tuple[Communicator, Callable[[bool], None]]:
        """For an optimizer that exchanges gradients itself (1-bit Adam after its warm-up):
        the group it exchanges over, and a switch that stops backward reducing.

        Stage 0: the data-parallel (replicate) group; the local gradients are the full
        buffers the optimizer's own `.grad`s point into. Stages 1-2: the shard group, and
        the optimizer reads every unit's whole local gradient with `local_gradient(unit)`
        (stage 1 has the buffer; stage 2 gets one when the switch first goes on, since the
        optimizer needs the whole window's gradient at its step, where clipping and loss
        scaling are known). Hybrid sharding would need a second, cross-group exchange."""
        if self.partitions_parameters:
            raise ValueError(f"{who} runs at zero_optimization.stage 0, 1 or 2, not 3: after its warm-up every rank "
                             "needs the whole momentum, its whole error buffer and its whole local gradient, more "
                             "than stage 3 saves, and stage 3 frees gathered parameters only as gradients are "
                             "reduced, which that phase never does (optim/onebit.py)")
        if self.shard.size > 1 and self.replicate.size > 1:
            raise ValueError(f"{who} with hybrid sharding (mics_shard_size) is not supported: its compressed "
                             f"momentum exchange runs over one group, here {self.shard.size} shard ranks x "
                             f"{self.replicate.size} replicas")

        def use_local_gradients(on: bool) -> None:
            if on and not self.keeps_full_grads and self._local_grads is None:
                self._allocate_local_gradients()
            if not on and self._local_grads is not None:  # back to buckets (a load mid-window, before the freeze)
                for unit in self.units:
                    for slot in unit.slots:
                        slot.param.grad = None
            self.optimizer_exchanges = on

        return (self.replicate if self.shard.size == 1 else self.shard), use_local_gradients

    def local_gradient(self, unit: FlatUnit) -> torch.Tensor:
        """The whole unit's unreduced gradient of this window (1-bit phase, stages 1-2)."""
        if self.keeps_full_grads:
            return self.store.full_gradient(unit)
        return self._local_grads[unit.index]

    def _allocate_local_gradients(self) -> None:
        flat = torch.zeros(sum(unit.padded_numel for unit in self.units), dtype=self.accumulation_dtype,
                           device=self.device)
        self.ledger.hold("grads", tensor_bytes(flat))
        self._local_grads = list(torch.split(flat, [unit.padded_numel for unit in self.units]))
        for unit, full in zip(self.units, self._local_grads):
            for slot in unit.slots:
                self._slot_views[id(slot)] = full[slot.offset : slot.offset + slot.numel].view(slot.shape)
                slot.param.grad = None
        self._written = [set() for _ in self.units]
