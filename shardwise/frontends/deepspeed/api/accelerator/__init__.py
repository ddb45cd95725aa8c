"""`deepspeed.accelerator.get_accelerator()`: the device questions training scripts ask.

DeepSpeed picks an accelerator class per device kind; scripts use it to stay
device-neutral (`device_name(local_rank)`, `set_device`, `manual_seed_all`,
`synchronize`, streams and events for overlap, memory figures for logs, tensor types in
older scripts...). Here there are two kinds, the ones shardwise trains on: CUDA when
torch sees a GPU, else the CPU (gloo), each answering every public question of
DeepSpeed 0.19.8's `DeepSpeedAccelerator` as DeepSpeed's class for that device does (the
CPU's device name is "cpu" whatever the index; its memory figures are the process's
resident memory, read from /proc where DeepSpeed asks psutil; it has no streams, events
or graphs, and its `stream()` and `capture_to_graph()` are empty contexts).
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
from typing import Any, Callable

import torch

__all__ = ["Accelerator", "get_accelerator", "is_current_accelerator_supported"]


class Accelerator:
    def __init__(self, kind: str):
        self.kind = kind  # "cuda" or "cpu"
        self._cuda = kind == "cuda"
        self._compile_backend = "inductor"
        self._peak_rss = _resident_bytes()  # the CPU's "max memory allocated" since the last reset

    # -- how the device runs (DeepSpeed's timers and overlap read these) -------------------
    def is_synchronized_device(self) -> bool:
        """Whether work finishes before the call returns: the CPU's does, a GPU's is queued."""
        return not self._cuda

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

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

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1, **options: Any) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def pin_empty(self, *size: Any, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        return self.pin_memory(torch.empty(shape, dtype=dtype, device=device))

    def pin_empty_like(self, tensor: torch.Tensor, device: str = "cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.pin_empty(tuple(tensor.shape), dtype=tensor.dtype if dtype is None else dtype, device=device)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return self._cuda and tensor.is_pinned()

    def unpin_memory(self, tensor: torch.Tensor) -> None:
        """Pinned tensors are released with their storage (torch's pinning): nothing to do."""

    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        return False

    def unregister_host_memory(self, address: int) -> None:
        return None

    def pin_memory_alignment(self) -> int:
        return 1

    # -- random numbers ----------------------------------------------------------------
    def random(self):
        return torch.random

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index] if self._cuda else torch.default_generator

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

    # -- streams, events and graphs (none on the CPU, as DeepSpeed's CPU class) ----------
    @property
    def Stream(self):  # noqa: N802 (DeepSpeed's name)
        return torch.cuda.Stream if self._cuda else None

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None):
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index: int | None = None):
        return torch.cuda.default_stream(device_index) if self._cuda else None

    @property
    def Event(self):  # noqa: N802
        return torch.cuda.Event if self._cuda else None

    def is_current_stream_capturing(self) -> bool:
        return self._cuda and torch.cuda.is_current_stream_capturing()

    def create_graph(self):
        return torch.cuda.CUDAGraph() if self._cuda else None

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> contextlib.AbstractContextManager:
        return torch.cuda.graph(graph, pool, stream) if self._cuda else contextlib.nullcontext()

    def replay_graph(self, graph: Any) -> None:
        if self._cuda:
            graph.replay()

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return torch.cuda._lazy_call(callback) if self._cuda else callback()

    # -- tensor types (older scripts build tensors with them) ----------------------------
    def _tensor_type(self, dtype: torch.dtype, cpu_type: Any) -> Any:
        """CUDA: `torch.tensor` on the GPU in `dtype`, as DeepSpeed's CUDA class gives;
        the CPU: torch's legacy type, as its CPU class gives."""
        return functools.partial(torch.tensor, dtype=dtype, device="cuda") if self._cuda else cpu_type

    @property
    def BFloat16Tensor(self):  # noqa: N802
        return self._tensor_type(torch.bfloat16, torch.BFloat16Tensor)

    @property
    def ByteTensor(self):  # noqa: N802
        return self._tensor_type(torch.uint8, torch.ByteTensor)

    @property
    def DoubleTensor(self):  # noqa: N802
        return self._tensor_type(torch.double, torch.DoubleTensor)

    @property
    def FloatTensor(self):  # noqa: N802
        return self._tensor_type(torch.float, torch.FloatTensor)

    @property
    def HalfTensor(self):  # noqa: N802
        return self._tensor_type(torch.half, torch.HalfTensor)

    @property
    def IntTensor(self):  # noqa: N802
        return self._tensor_type(torch.int, torch.IntTensor)

    @property
    def LongTensor(self):  # noqa: N802
        return self._tensor_type(torch.long, torch.LongTensor)

    # -- data types --------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def is_fp64_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    def is_triton_supported(self) -> bool:
        """CUDA compute capability 8 and later, as DeepSpeed's CUDA class says; never the CPU."""
        return self._cuda and torch.cuda.get_device_capability()[0] >= 8

    def prefer_triton_grouped_mm(self) -> bool:
        return False

    # -- memory ------------------------------------------------------------------------
    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def _resident(self) -> int:
        """The CPU's memory figure: the process's resident bytes, its peak kept up to date."""
        self._peak_rss = max(self._peak_rss, resident := _resident_bytes())
        return resident

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else self._resident()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        self._resident()
        return self._peak_rss

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else self._resident()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_reserved(device_index)
        return self.max_memory_allocated(device_index)

    def memory_cached(self, device_index: int | None = None) -> int:
        """DeepSpeed's older name for the reserved memory."""
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        if self._cuda:
            return torch.cuda.memory_stats(device_index)
        current = self._resident()
        return {"allocated_bytes.all.current": current, "allocated_bytes.all.peak": self._peak_rss}

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._peak_rss = _resident_bytes()

    def available_memory(self, device_index: int | None = None) -> int:
        """CUDA: the device's free bytes; the CPU: the host's available bytes (/proc/meminfo)."""
        if self._cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        return _host_available_bytes()

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    # -- profiling ranges (NVTX on CUDA; nothing on the CPU, as DeepSpeed's CPU class) ---
    def range_push(self, msg: str, *args: Any, **options: Any) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self, *args: Any, **options: Any) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    def supports_nvtx_domain(self) -> bool:
        return False

    # -- ops, launchers and compilers ------------------------------------------------------
    def op_builder_dir(self) -> str:
        return "deepspeed.ops.op_builder"

    def get_op_builder(self, class_name: str) -> type:
        """The builder class of that name (ops/op_builder.py: each says which Python class
        does its op); for one shardwise does not list, as DeepSpeed, a builder whose
        `load()` fails."""
        from shardwise.frontends.deepspeed.api.ops.op_builder import builder_named

        return builder_named(class_name)

    def create_op_builder(self, op_name: str) -> Any:
        return self.get_op_builder(op_name)()

    def build_extension(self) -> type:
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension

    def export_envs(self) -> list[str]:
        """Environment-variable prefixes the launcher passes on to other nodes."""
        return ["NCCL"] if self._cuda else []

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids: list[int]) -> None:
        for name in self.visible_devices_envs():
            current_env[name] = ",".join(map(str, local_accelerator_ids))

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(f"{backend} not supported by {self.device_name()}. Supported Backends are {known}")
        self._compile_backend = backend


def _resident_bytes() -> int:
    """This process's resident memory (/proc/self/statm; elsewhere its peak, from getrusage)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak * 1024 if os.uname().sysname == "Linux" else peak


def _host_available_bytes() -> int:
    """The host's available memory (MemAvailable of /proc/meminfo; elsewhere free pages)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


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
