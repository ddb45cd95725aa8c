"""Random draws `initialize` makes for itself, without touching the caller's streams.

Building a model partitioned from the meta device and timing layers for a pipeline split
draw random numbers (initial weights, synthetic token ids, dropout masks). Those draws
must leave every generator the caller can see where it was: a script's later draws (its
data order, a GAN's noise, dropout) must not depend on the ZeRO stage or on whether the
model was built on the meta device. `torch.random.fork_rng(devices=[])` alone restores
only the CPU generator, and `torch.manual_seed` reseeds every CUDA device (lazily, when
CUDA is not initialised yet, so even a later restore would not undo it); here the CUDA
generators the block may draw from are forked too, and only those are seeded.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


def cuda_generators_to_fork(device: torch.device) -> list[int]:
    """The CUDA devices whose generators a block running on `device` may draw from: the
    training device's and CUDA's current device, once CUDA is in use (forking a device
    initialises CUDA, which a CPU run must never do)."""
    indices = set()
    if device.type == "cuda":
        indices.add(device.index if device.index is not None else torch.cuda.current_device())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        indices.add(torch.cuda.current_device())
    return sorted(indices)


@contextmanager
def preserved_rng(device: torch.device) -> Iterator[list[int]]:
    """Draw freely inside the block; the CPU generator and those of
    `cuda_generators_to_fork(device)` are restored after it. Yields those CUDA indices."""
    devices = cuda_generators_to_fork(device)
    with torch.random.fork_rng(devices=devices):
        yield devices


@contextmanager
def seeded_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Inside the block the CPU generator and `device`'s own start from `seed` (the same
    numbers on every rank given the same seed); every generator is restored after it."""
    with preserved_rng(device) as cuda_devices:
        torch.default_generator.manual_seed(seed)
        for index in cuda_devices:  # forked above, so CUDA is initialised: seeded now, not lazily
            torch.cuda.default_generators[index].manual_seed(seed)
        yield
