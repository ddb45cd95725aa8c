"""The optimizer step on the slice of the model this rank owns (ZeRO-1/2/3, C2).

The torch optimizer (the user's, any class: its groups and hyper-parameters are kept; or
one built from the config's registry entry) is pointed at the store's fp32 *segments*:
runs of this rank's chunk of each unit that belong to one param group. Optimizer state is
created lazily by torch, so it only ever exists for the owned 1/N.

The step walks the store's sub-groups of about `sub_group_size` elements, each inside
`store.resident(...)` so a paging tier can bring that sub-group in and write it back.
torch skips parameters whose `.grad` is None, so giving gradients to one sub-group at a
time bounds the fp32 gradient copies that mixed precision needs by a constant instead of
the model size.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

from shardwise.runtime.accounting import MemoryLedger, tensor_bytes
from shardwise.runtime.optim.codec import ElementwiseCodec, StateCodec
from shardwise.runtime.optim.onebit import OneBitOptimizer
from shardwise.runtime.optim.sharded import ParameterShard, ShardAwareOptimizer, SumOverShards
from shardwise.runtime.zero.gradients import GradientReducer
from shardwise.runtime.zero.onebit_momentum import PartitionedMomentum
from shardwise.runtime.zero.shard_store import SegmentState, ShardStore


class ShardedOptimizer:
    def __init__(
        self,
        store: ShardStore,
        ledger: MemoryLedger,
        make_optimizer: Callable[[list[list[torch.Tensor]]], torch.optim.Optimizer],
        codec: StateCodec | None = None,
        sum_over_shards: SumOverShards | None = None,
        sum_data_over_shards: SumOverShards | None = None,
        reducer: GradientReducer | None = None,
    ):
        """`make_optimizer` receives, per param group, the fp32 segments to train;
        `codec` says how its state is saved and resharded (default: per-element state).
        A `ShardAwareOptimizer` (the store then holds one segment per parameter piece) is
        told which piece each segment is, and sums its statistics with `sum_over_shards`
        (small, control traffic) or parameter-sized tensors with `sum_data_over_shards`.
        An optimizer that exchanges gradients itself (1-bit Adam / LAMB) gets the
        `reducer`'s data-parallel group and its switch to local gradients."""
        self.store = store
        self.ledger = ledger
        self.segments: list[SegmentState] = store.segments
        self.optimizer = make_optimizer(self._segments_by_group())
        self.codec = codec or ElementwiseCodec()
        if isinstance(self.optimizer, ShardAwareOptimizer):
            self._attach_shards(sum_over_shards, sum_data_over_shards)
        if isinstance(self.optimizer, OneBitOptimizer) and reducer is not None:
            communicator, use_local_gradients = reducer.exchange_for_optimizer(type(self.optimizer).__name__)
            partitions = None
            if reducer.shard.size > 1:  # stages 1-2: the whole momentum laid out over the partitions
                partitions = PartitionedMomentum(store.units, communicator, self.segments, reducer.local_gradient)
            self.optimizer.attach_gradient_exchange(communicator, use_local_gradients, partitions)
        self.record_state_bytes()

    @property
    def param_groups(self) -> list[dict]:
        """The torch optimizer's groups (hyper-parameters and this rank's fp32 segments):
        where scripts read and set the learning rate through `engine.optimizer`, as on
        DeepSpeed's ZeRO optimizers, which expose their wrapped optimizer's groups."""
        return self.optimizer.param_groups

    def _segments_by_group(self) -> list[list[torch.Tensor]]:
        by_group: dict[int, list[torch.Tensor]] = defaultdict(list)
        for segment in self.segments:
            by_group[segment.group].append(segment.master)
        groups = 1 + max(slot.group for unit in self.store.units for slot in unit.slots)
        return [by_group.get(index, []) for index in range(groups)]

    def _attach_shards(self, sum_over_shards: SumOverShards | None,
                       sum_data_over_shards: SumOverShards | None) -> None:
        if any(segment.piece is None for segment in self.segments):
            raise ValueError(f"{type(self.optimizer).__name__} needs whole-parameter statistics: build the "
                             "shard store with per_parameter=True")
        slots = [slot for unit in self.store.units for slot in unit.slots]
        index = {id(slot): position for position, slot in enumerate(slots)}
        shards = {
            segment.master: ParameterShard(segment.piece.slot.name, tuple(segment.piece.slot.shape),
                                           segment.piece.start, segment.piece.stop, index[id(segment.piece.slot)])
            for segment in self.segments
        }
        identity = lambda tensor: tensor  # noqa: E731  (one rank: nothing to sum)
        self.optimizer.attach_shards(shards, len(slots), sum_over_shards or identity, sum_data_over_shards or identity)

    # -- norms ---------------------------------------------------------------------------
    def local_grad_norm_squared(self) -> torch.Tensor:
        """Sum of squared owned gradients, accumulated in fp32 (fp16 squares overflow); a
        1-bit optimizer past its warm-up at stages 1-2 gives its share of the local norms."""
        if isinstance(self.optimizer, OneBitOptimizer) and self.optimizer.reads_local_gradients():
            return self.optimizer.local_grad_norm_squared()
        norms = [torch.linalg.vector_norm(grad, dtype=torch.float32) for grad in self.store.gradients()]
        return torch.stack([norm.to(norms[0].device) for norm in norms]).square().sum()  # tiers may differ

    # -- the update ------------------------------------------------------------------------
    def step(self, grad_scale: float) -> None:
        """Update owned parameters with gradients multiplied by `grad_scale`
        (loss-scale inverse times clip coefficient), then publish them."""
        if isinstance(self.optimizer, OneBitOptimizer) and self.optimizer.reads_local_gradients():
            self.optimizer.step_on_local_gradients(grad_scale)  # one sub-group: per-parameter store
            self.store.publish()
            self.record_state_bytes()
            return
        for sub_group in self.store.sub_groups:
            with self.store.resident(sub_group):
                self._step_sub_group(sub_group, grad_scale)
                self.store.adopt_state(sub_group, self.optimizer.state)
                self.store.publish(sub_group)
        self.record_state_bytes()

    def _step_sub_group(self, sub_group: list[SegmentState], grad_scale: float) -> None:
        copied = 0
        for segment in sub_group:
            grad = segment.grad
            if grad.dtype != segment.master.dtype:  # 16-bit gradients of fp32 masters
                grad = grad.to(segment.master.dtype)
                copied += tensor_bytes(grad)
            if grad_scale != 1.0:
                grad.mul_(grad_scale)
            segment.master.grad = grad
        self.ledger.hold("buffers", copied)
        try:
            self.optimizer.step()
        finally:
            for segment in sub_group:
                segment.master.grad = None
            self.ledger.release("buffers", copied)

    def record_state_bytes(self) -> None:
        """Master copy plus the optimizer state the codec counts per element."""
        by_tier = self.store.state_bytes_by_tier(
            lambda segment: self.codec.state_bytes(self.optimizer.state.get(segment.master, {}), segment.numel))
        if isinstance(self.optimizer, OneBitOptimizer):  # its error-feedback buffers
            by_tier[self.store.state_tier] += self.optimizer.exchange_state_bytes()
        for tier, total in by_tier.items():
            self.ledger.set("optimizer_states", total, tier=tier)
