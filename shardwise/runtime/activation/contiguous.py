"""Md: activation checkpoints in one preallocated contiguous buffer (ZeRO-R, C10).

Checkpoints live from a layer's forward to its recomputation, interleaved with
short-lived tensors; on a caching allocator (CUDA) that interleaving fragments memory,
so a large allocation can fail while enough bytes are free in pieces. ZeRO-R's answer is
to copy the long-lived tensors into a buffer allocated once. The arena hands out slots
of that buffer in order within a step; the step ends when every slot has been released
(backward has used them all), and the next request starts again at offset 0. The first
step's requests are served by ordinary allocations while the arena learns the step's
total; from then on one buffer of that size serves them (with `number_checkpoints`, as
in DeepSpeed, the buffer is sized at the first request: that many of it). A step asking
for more than the buffer holds (a longer sequence, two forwards before a backward) gets
ordinary allocations for the excess, counted in `overflows`, and the buffer grows to the
new total at the next step.
"""

from __future__ import annotations

import torch

ALIGNMENT = 64  # bytes: every slot starts on a boundary any dtype (and vector loads) accept


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class ContiguousArena:
    def __init__(self, device: torch.device, pin_memory: bool = False, number_checkpoints: int | None = None):
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        self.number_checkpoints = number_checkpoints
        self.buffer: torch.Tensor | None = None
        self.offset = 0
        self.live = 0  # slots handed out and not yet released
        self.demand = 0  # bytes requested since the step began
        self.overflows = 0
        self.allocations = 0  # times the buffer was (re)allocated

    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def slot(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor for one checkpoint; call `release()` when it is dropped."""
        numel = shape.numel()
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self.live == 0:
            self._begin_step(_aligned(nbytes))
        self.live += 1
        self.demand += _aligned(nbytes)
        if self.buffer is None or self.offset + nbytes > self.capacity:
            self.overflows += 1
            return torch.empty(shape, dtype=dtype, device=self.device, pin_memory=self.pin_memory)
        view = self.buffer[self.offset : self.offset + nbytes].view(dtype).view(shape)
        self.offset += _aligned(nbytes)
        return view

    def release(self) -> None:
        self.live -= 1

    def _begin_step(self, first_request: int) -> None:
        """Every slot of the previous step is free: rewind, and size the buffer to the
        previous step's demand (or to `number_checkpoints` first requests)."""
        wanted = self.demand
        if self.buffer is None and self.number_checkpoints:
            wanted = max(wanted, self.number_checkpoints * first_request)
        if wanted > self.capacity:
            self.buffer = None
            if self.device.type == "cuda":
                # The buffer replaces the blocks the last step's checkpoints were allocated
                # in, now free but still cached; left there, the buffer was carved out of
                # one of them and the rest stayed reserved (on the first H100 run, 1.1 GB
                # of inactive split blocks and 1.6-1.7 GB more reserved than without the
                # buffer). Given back first, the buffer gets a segment of its own.
                torch.cuda.empty_cache()
            self.buffer = torch.empty(wanted, dtype=torch.uint8, device=self.device, pin_memory=self.pin_memory)
            self.allocations += 1
        self.offset = 0
        self.demand = 0
