"""`deepspeed.accelerator.get_accelerator()`: the device questions training scripts ask.

DeepSpeed picks an accelerator class per device kind; scripts use a small part of it to
stay device-neutral (`device_name(local_rank)`, `set_device`, `manual_seed_all`,
`synchronize`...). Here there are two kinds, the ones shardwise trains on: CUDA when
torch sees a GPU, else the CPU (gloo), each answering as DeepSpeed's class for that
device does (the CPU's device name is "cpu" whatever the index).
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["Accelerator", "get_accelerator", "is_current_accelerator_supported"]


class Accelerator:
    def __init__(self, kind: str):
        self.kind = kind  # "cuda" or "cpu"
        self._cuda = kind == "cuda"

    # -- devices -----------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        if not self._cuda or device_index is None:
            return self.kind
        return f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        """GPUs; on the CPU, the processes on this node (DeepSpeed reads LOCAL_SIZE)."""
        if self._cuda:
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", 1)))

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.kind

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    # -- random numbers ----------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state(device_index or "cuda") if self._cuda else torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, device_index or "cuda")
        else:
            torch.set_rng_state(new_state)

    # -- data types --------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    # -- memory ------------------------------------------------------------------------
    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    # -- profiling ranges (NVTX on CUDA; nothing on the CPU, as DeepSpeed's CPU class) ---
    def range_push(self, msg: str, *args: Any) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self, *args: Any) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The one accelerator of this process, chosen on first use."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator("cuda" if torch.cuda.is_available() else "cpu")
    return _ACCELERATOR


def is_current_accelerator_supported() -> bool:
    """Whether this process's accelerator is one the package runs on: always, since it
    chooses between the two shardwise trains on (DeepSpeed's test harness asks first)."""
    return get_accelerator().kind in ("cuda", "cpu")
