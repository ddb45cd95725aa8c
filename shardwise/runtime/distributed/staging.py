"""Host tensors through a device-only group: NCCL moves CUDA tensors and nothing else.

Some tensors a collective must move live in host memory by design: a model's weights
before `initialize` moves it to the device (tensor parallelism broadcasts them while it
splits the model, so the full model never sits on one device), an offloaded optimizer's
whole-parameter sums, a layout built on the CPU. Over a gloo group they go as they are;
over an NCCL group a device copy goes instead and the result is copied back, one tensor
at a time, so the device holds one such tensor at most.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist


def group_device(group: dist.ProcessGroup | None) -> torch.device | None:
    """The device `group`'s collectives move tensors on: the current CUDA device for an
    NCCL group; None for a group that takes tensors where they are (gloo, or no process
    group at all). `group` None is the default group, as in torch.distributed (a world of
    one rank hands it out as the replicate group)."""
    if not dist.is_initialized() or dist.get_backend(group) != "nccl":
        return None
    return torch.device("cuda", torch.cuda.current_device())


@contextmanager
def staged_on(tensor: torch.Tensor, device: torch.device | None) -> Iterator[torch.Tensor]:
    """`tensor` itself when `device` is None or holds it already, else a copy on `device`
    whose contents are written back into `tensor` after the block."""
    if device is None or tensor.device == device:
        yield tensor
        return
    staged = tensor.to(device)
    yield staged
    tensor.copy_(staged)
