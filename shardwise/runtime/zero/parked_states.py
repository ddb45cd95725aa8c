"""Training states moved out of the device between phases: `engine.offload_states()` and
`engine.reload_states()` (DeepSpeed's names), which RLHF loops call around generation so
that an inference engine can use the memory the optimizer held.

How: each storage is copied whole into a host buffer (pinned when it leaves a CUDA
device) and then resized to nothing; reloading resizes it back and copies the bytes in.
A storage keeps its identity, so every view of it (a parameter's `.data`, a segment's
master, a gradient partition, an optimizer state) is valid again after the reload with
no pointer to re-link, and until then any read of it fails loudly ("data is not
allocated") instead of reading stale memory. DeepSpeed's ZeRO optimizers instead swap
each buffer's `.data` for a host tensor and re-link the views they know of (its
stage_1_and_2.py and stage3.py `offload_states`).

A storage that cannot be resized (a host-shared segment: zero/shared_param_home.py) is
host memory already and stays. Scratch storages (the gradient buckets, refilled before
every use) are freed without a copy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterable

import torch

log = logging.getLogger("shardwise")


class StateKind(str, Enum):
    """What an offload moves. The values are DeepSpeed's `OffloadStateTypeEnum` values."""

    OPTIMIZER_STATES = "optim_states"  # the optimizer's moments and other per-element state
    MASTER_PARAMETERS = "hp_params"  # the fp32 (or 16-bit) masters the optimizer trains
    PARAMETERS = "lp_params"  # the parameters forward reads (stage 3: this rank's shards)
    GRADIENTS = "lp_grads"  # the reduced gradients (partitions, or whole buffers at stages 0-1)
    GRADIENT_BUCKETS = "contiguous_grad_buffer"  # the reduction buckets (scratch)


SCRATCH_KINDS = frozenset({StateKind.GRADIENT_BUCKETS})


@dataclass
class _Parked:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # the bytes, None for a scratch storage


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class ParkedStates:
    """The storages moved out, by kind; `kinds` are those offloaded (asked and not reloaded)."""

    def __init__(self) -> None:
        self.kinds: set[StateKind] = set()
        self._parked: list[_Parked] = []
        self._parked_at: set[int] = set()  # data pointers of the storages moved, before the move
        self._by_kind: dict[StateKind, list[torch.Tensor]] | None = None  # the tensors, until the reload

    def park(self, state_tensors: Callable[[], dict[StateKind, list[torch.Tensor]]], include: Iterable[StateKind],
             *, pin_memory: bool, non_blocking: bool, device: torch.device) -> int:
        """Move the storages of the kinds in `include` that live on `device` (on a CPU
        engine: all of them) and belong to no kind left out: in fp32 the masters are the
        parameters themselves, so offloading only the masters leaves them, where forward
        reads them. `state_tensors()` is asked once until the reload: views of a moved
        storage cannot be cut again while it holds nothing, and nothing trains meanwhile.
        Returns the bytes moved off."""
        if self._by_kind is None:
            self._by_kind = state_tensors()
        by_kind, include = self._by_kind, set(include)
        kept = {_key(tensor) for kind, tensors in by_kind.items() if kind not in include for tensor in tensors}
        moved, fixed = 0, {}
        for kind in include:
            for tensor in by_kind.get(kind, ()):
                storage = tensor.untyped_storage()
                key = _key(tensor)
                if (key in kept or key in self._parked_at or storage.nbytes() == 0
                        or storage.device.type != device.type):
                    continue
                if not storage.resizable():
                    fixed[key] = storage.nbytes()
                    continue
                host = None
                if kind not in SCRATCH_KINDS:
                    host = torch.empty(storage.nbytes(), dtype=torch.uint8,
                                       pin_memory=pin_memory and storage.device.type == "cuda")
                    host.copy_(_bytes_of(storage), non_blocking=non_blocking and host.is_pinned())
                self._parked.append(_Parked(storage, storage.nbytes(), host))
                self._parked_at.add(key)
                moved += storage.nbytes()
                storage.resize_(0)
            self.kinds.add(kind)
        if fixed and device.type != "cpu":
            log.warning("shardwise: offload_states() left %d bytes on %s: ZeRO-3's one-rank home hands its "
                        "shards out over one region, which cannot be moved piece by piece", sum(fixed.values()),
                        device)
        return moved

    def reload(self, *, non_blocking: bool) -> None:
        """Every parked storage back at its size, with its bytes."""
        for parked in self._parked:
            parked.storage.resize_(parked.nbytes)
            if parked.host is not None:
                _bytes_of(parked.storage).copy_(parked.host, non_blocking=non_blocking and parked.host.is_pinned())
        self._parked, self._parked_at, self.kinds, self._by_kind = [], set(), set(), None


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in a torch optimizer's per-parameter state (nested lists and dicts too)."""
    found: list[torch.Tensor] = []

    def collect(value: object) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                collect(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                collect(item)

    collect(list(optimizer.state.values()))
    return found


def _key(tensor: torch.Tensor) -> int:
    """A storage's identity while it holds memory (its data pointer)."""
    return tensor.untyped_storage().data_ptr()
