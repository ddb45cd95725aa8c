"""ZeRO-Offload's host tier (C11): fp32 masters, optimizer state and the reduced gradient
partition in host memory; the optimizer steps there, on the CPU.

What stays on the device: the 16-bit (or fp32) parameters the model computes with, and,
in stages 0-1, the full gradient buffer the micro-batches accumulate into (the reduced
owned slice is handed to the host at the boundary). Stages 2-3 hand every reduced bucket
chunk over as it arrives, so the device keeps no gradient partition at all (Ren et al.,
2021: "ZeRO-Offload"). The host partition is fp32: the CPU optimizer steps in fp32, so
gradients are upcast once on arrival instead of at every use.

The design is device-generic: on a CPU-only machine the "host" is the same memory as the
"device", but the buffers are separate and counted under the host tier, so tests check
where every byte would live on a GPU machine. Reduced chunks reach the host partition
through `GradientCopies` (gradient_copies.py): asynchronous copies into reused staging
buffers, added in when the optimizer (or the gradient norm) reads them.

`offload_optimizer.pin_memory` means what it means in DeepSpeed: the host buffers of the
offloaded state (masters, the gradient partition and the staging buffers its copies land
in) are page-locked, so copies between device and host run asynchronously, at the cost of
memory the operating system cannot page out. It applies when CUDA is available; without
it there is nothing to pin for.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from shardwise.runtime.accounting import tensor_bytes
from shardwise.runtime.zero.gradient_copies import GradientCopies, side_stream_for
from shardwise.runtime.zero.layout import FlatUnit
from shardwise.runtime.zero.shard_store import SegmentState, ShardStore, StoreSpec
from shardwise.runtime.zero.strategy import ParameterStrategy

HOST = torch.device("cpu")


@dataclass(frozen=True)
class HostGradients:
    partition_flat: torch.Tensor  # fp32, host: this rank's reduced chunks
    partition: list[torch.Tensor]  # one view per unit
    full_flat: torch.Tensor | None  # stages 0-1: the device accumulation buffer
    full: list[torch.Tensor] | None
    copies: GradientCopies  # reduced chunks on their way into `partition`


def host_gradients(spec: StoreSpec, pin_memory: bool) -> HostGradients:
    """The gradient buffers of an offloaded optimizer: an fp32 partition in host memory
    (page-locked with `pin_memory` and CUDA) and, for stages 0-1, the full accumulation
    buffer on the device."""
    units, ledger = spec.units, spec.ledger
    device = spec.device  # not the shards': offloaded parameters live on the host, their gradients do not
    full_flat = full = None
    if spec.keeps_full_gradients:
        sizes = [unit.padded_numel for unit in units]
        full_flat = torch.zeros(sum(sizes), dtype=spec.grad_dtype, device=device)
        ledger.hold("grads", tensor_bytes(full_flat))
        full = list(torch.split(full_flat, sizes))
    sizes = [unit.chunk_numel for unit in units]
    pin = pin_memory and torch.cuda.is_available()
    partition_flat = torch.zeros(sum(sizes), dtype=torch.float32, device=HOST, pin_memory=pin)
    ledger.hold("grads", tensor_bytes(partition_flat), tier="host")
    copies = GradientCopies(chunk_numel=max(sizes), pin=pin, ledger=ledger, stream=side_stream_for(device))
    return HostGradients(partition_flat, list(torch.split(partition_flat, sizes)), full_flat, full, copies)


def masters_from_chunks(units: list[FlatUnit], strategy: ParameterStrategy,
                        pin: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """fp32 host copies of this rank's parameter chunks, one unit at a time (a paging
    parameter home keeps only a few chunks in memory at once)."""
    sizes = [unit.chunk_numel for unit in units]
    flat = torch.empty(sum(sizes), dtype=torch.float32, device=HOST, pin_memory=pin)
    views = list(torch.split(flat, sizes))
    for unit, view in zip(units, views):
        view.copy_(strategy.owned_chunk(unit))
    return flat, views


class HostGradientStore(ShardStore):
    """What the host and NVMe tiers share: the reduced gradient partition in host memory,
    filled through `GradientCopies`; whoever reads a unit's gradient (the norm, a
    sub-group's step) first settles that unit's copies."""

    tier = "host"  # where the gradient partition lives

    def _host_gradients(self, spec: StoreSpec, pin_memory: bool) -> HostGradients:
        gradients = host_gradients(spec, pin_memory)
        self.grad_flat, self.full_flat, self.copies = gradients.partition_flat, gradients.full_flat, gradients.copies
        self.moved: Counter = Counter()
        return gradients

    def receive_gradient(self, unit: FlatUnit, reduced: torch.Tensor) -> Any:
        self.moved["device_to_host"] += tensor_bytes(reduced)
        return self.copies.receive(unit.index, reduced, super().gradient(unit))

    def summing_target(self, unit: FlatUnit) -> torch.Tensor | None:
        return None  # a chunk is copied to the host, not summed where it was reduced

    def gradient(self, unit: FlatUnit) -> torch.Tensor:
        self.copies.settle([unit.index])
        return super().gradient(unit)

    def gradients(self) -> list[torch.Tensor]:
        return [self.gradient(unit) for unit in self.units]  # each unit's copies waited for in turn

    def settle(self, sub_group: list[SegmentState]) -> None:
        """The gradients `sub_group` reads are all in the partition."""
        self.copies.settle({segment.unit for segment in sub_group})

    def start_window(self) -> None:
        """The host partition collects this window's reduced gradients from zero."""
        self.copies.discard()
        self.grad_flat.zero_()

    def zero_gradients(self) -> None:
        self.copies.discard()
        self.grad_flat.zero_()
        if self.full_flat is not None:
            self.full_flat.zero_()


class HostShardStore(HostGradientStore):
    state_tier = "host"

    def __init__(self, spec: StoreSpec, pin_memory: bool = False):
        pin = pin_memory and torch.cuda.is_available()
        # an optimizer on the host needs its own fp32 copy, whatever the training dtype
        self.master_flat, masters = masters_from_chunks(spec.units, spec.strategy, pin)
        gradients = self._host_gradients(spec, pin_memory)
        self._organise(spec, masters, gradients.full, gradients.partition)
        self.param_bytes = spec.param_dtype.itemsize

    @contextmanager
    def resident(self, sub_group: list[SegmentState]) -> Iterator[list[SegmentState]]:
        """Masters and state are in memory already; the gradients once their copies are in."""
        self.settle(sub_group)
        yield sub_group

    def publish(self, sub_group=None) -> None:
        if sub_group is not None:
            self.moved["host_to_device"] += sum(s.numel for s in sub_group) * self.param_bytes
        super().publish(sub_group)

    def transfers(self) -> dict[str, int]:
        return dict(self.moved)

    def master_bytes(self) -> int:
        return tensor_bytes(self.master_flat)
