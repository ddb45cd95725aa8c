"""How a checkpointed region keeps its inputs until recomputation: Pa, CPU, Md (ZeRO-R).

`torch.utils.checkpoint` (non-reentrant) saves a region's inputs as saved tensors before
it runs the region, so a saved-tensor hook pushed around the call sees exactly those
inputs, and sees them again when the recomputation asks for them. The store's pack hook
decides what is kept:

    Pa  (partition_activations)   each rank of the tensor-parallel group keeps 1/TP of
        the flattened input (padded to a multiple of TP); the recomputation all-gathers it.
        The full input is not referenced any more, so it is freed: checkpoint memory per
        rank really drops to 1/TP (DeepSpeed's issue #3779 reports theirs does not).
    CPU (cpu_checkpointing)       the kept tensor is copied to host memory (pinned, on a
        side stream, on CUDA) and copied back for the recomputation; DeepSpeed allows it
        only with Pa (its issue #541), here it works with or without.
    Md  (contiguous_memory_optimization)   the kept tensor is copied into the step's
        contiguous buffer (contiguous.py), on the host with CPU checkpointing.

Only activations are transformed: floating-point inputs that require grad (a layer's
hidden states). Masks, positions and rotary tables carry no gradient, are usually shared
by every layer, and would not be freed by copying them; they are kept as they are.
Everything kept is counted as "checkpoints" by the forward's ActivationTracker.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from shardwise.runtime.activation.accounting import ActivationTracker
from shardwise.runtime.activation.contiguous import ContiguousArena
from shardwise.runtime.activation.policy import ActivationPolicy
from shardwise.runtime.distributed.collectives import Communicator


@dataclass
class Stored:
    """One kept input: `data` (the whole tensor, or this rank's piece), how to rebuild it."""

    data: torch.Tensor
    shape: torch.Size
    device: torch.device
    partitioned: bool = False
    copied: torch.cuda.Event | None = None  # host copy in flight on the side stream
    arena: ContiguousArena | None = None

    def __del__(self) -> None:
        if self.arena is not None:
            self.arena.release()


class CheckpointStore:
    def __init__(
        self,
        partition: Communicator | None = None,
        to_host: bool = False,
        contiguous: bool = False,
        number_checkpoints: int | None = None,
    ):
        """`partition`: the tensor-parallel group to split inputs over (Pa); None or a
        group of one keeps them whole."""
        self.partition = partition if partition is not None and partition.size > 1 else None
        self.to_host = to_host
        self.contiguous = contiguous
        self.number_checkpoints = number_checkpoints
        self.arenas: dict[torch.device, ContiguousArena] = {}
        self._stream: torch.cuda.Stream | None = None

    @classmethod
    def for_policy(cls, policy: ActivationPolicy, tensor: Communicator | None) -> "CheckpointStore":
        """The store `policy` asks for; Pa splits over `tensor` (the tensor-parallel group)."""
        return cls(tensor if policy.partition_activations else None, policy.cpu_checkpointing,
                   policy.contiguous_memory_optimization, policy.number_checkpoints)

    @property
    def transforms(self) -> bool:
        return self.partition is not None or self.to_host or self.contiguous

    @contextmanager
    def saving(self, tracker: ActivationTracker | None) -> Iterator[None]:
        """Around `torch.utils.checkpoint.checkpoint`: its saved inputs go through the store."""
        def pack(tensor: torch.Tensor) -> Stored:
            return self.pack(tensor, tracker)

        with torch.autograd.graph.saved_tensors_hooks(pack, self.unpack):
            yield

    # -- save ----------------------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor, tracker: ActivationTracker | None = None) -> Stored:
        value = tensor.detach()
        stored = Stored(value, value.shape, value.device)
        # An empty tensor is left as it is: torch 2.9's checkpoint saves one beside the inputs.
        if tensor.is_floating_point() and tensor.requires_grad and tensor.numel() and self.transforms:
            if self.partition is not None:
                stored.data, stored.partitioned = self._piece(value), True
            if self.to_host:
                self._copy_to_host(stored)
            elif self.contiguous:
                self._copy_to_arena(stored, stored.data.device)
        if tracker is not None:
            host = self.to_host and stored.data.device.type == "cpu"
            tracker.watch(stored, "checkpoints", stored.data, tier="host" if host else "device")
        return stored

    def _piece(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's 1/TP of the flattened tensor, zero-padded to equal pieces."""
        group = self.partition
        flat = value.reshape(-1)
        chunk = -(-flat.numel() // group.size)
        start = min(group.rank * chunk, flat.numel())
        stop = min(start + chunk, flat.numel())
        piece = torch.zeros(chunk, dtype=value.dtype, device=value.device)
        piece[: stop - start].copy_(flat[start:stop])
        return piece

    def _copy_to_host(self, stored: Stored) -> None:
        source = stored.data
        if source.device.type == "cpu":  # already in host memory (a CPU-only job)
            if self.contiguous:
                self._copy_to_arena(stored, source.device)
            return
        pin = torch.cuda.is_available()
        if self.contiguous:
            arena = self._arena(torch.device("cpu"), pin)
            target, stored.arena = arena.slot(source.shape, source.dtype), arena
        else:
            target = torch.empty(source.shape, dtype=source.dtype, pin_memory=pin)
        if self._stream is None:
            self._stream = torch.cuda.Stream(source.device)
        self._stream.wait_stream(torch.cuda.current_stream(source.device))
        with torch.cuda.stream(self._stream):
            target.copy_(source, non_blocking=True)
            stored.copied = torch.cuda.Event()
            stored.copied.record(self._stream)
        source.record_stream(self._stream)
        stored.data = target

    def _copy_to_arena(self, stored: Stored, device: torch.device) -> None:
        arena = self._arena(device, False)
        target = arena.slot(stored.data.shape, stored.data.dtype)
        target.copy_(stored.data)
        stored.data, stored.arena = target, arena

    def _arena(self, device: torch.device, pin: bool) -> ContiguousArena:
        if device not in self.arenas:
            self.arenas[device] = ContiguousArena(device, pin, self.number_checkpoints)
        return self.arenas[device]

    # -- recompute ------------------------------------------------------------------------------
    def unpack(self, stored: Stored) -> torch.Tensor:
        data = stored.data
        if stored.copied is not None:
            stored.copied.synchronize()
        if data.device != stored.device:
            data = data.to(stored.device, non_blocking=True)
        if not stored.partitioned:
            return data.view(stored.shape) if data.shape != stored.shape else data
        group = self.partition
        full = torch.empty(data.numel() * group.size, dtype=data.dtype, device=data.device)
        group.all_gather(full, data, "partitioned activation checkpoint").wait()
        return full[: stored.shape.numel()].view(stored.shape)
