"""`deepspeed.runtime.utils`: the helpers scripts and model code import from it:
`set_random_seed`, the layer-partitioning functions pipeline code uses to assign layers
to stages (`partition_uniform`, `partition_balanced`, `prefix_sum_inc`),
`PartitionedTensor` (a tensor cut into one flat, contiguous piece per rank of a group,
which pipeline code sends between stages as its pieces plus a small meta tensor),
`see_memory_usage`, `move_to_device` and `clip_grad_norm_` (clipping by the norm over
model-parallel pieces, averaged over the data-parallel group as DeepSpeed does for
expert parameters, whose gradients differ between those ranks)."""

from __future__ import annotations

import logging
import math
import random
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist

from shardwise.frontends.deepspeed.api.utils import groups

__all__ = ["PartitionedTensor", "clip_grad_norm_", "move_to_device", "partition_balanced", "partition_uniform",
           "prefix_sum_inc", "see_memory_usage", "set_random_seed"]

log = logging.getLogger("DeepSpeed")


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (every device's)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def prefix_sum_inc(weights: list) -> list:
    """Inclusive prefix sums: [3, 4, 5] -> [3, 7, 12]."""
    sums, total = [], 0
    for weight in weights:
        total = total + weight
        sums.append(total)
    return sums


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """`num_parts + 1` boundaries cutting `num_items` items into parts whose sizes differ by
    at most one, the larger parts first; with fewer items than parts, one item per part
    and empty parts at the end."""
    if num_items <= num_parts:
        return [min(part, num_items) for part in range(num_parts + 1)]
    size, extra = divmod(num_items, num_parts)
    return [part * size + min(part, extra) for part in range(num_parts + 1)]


def partition_balanced(weights: list, num_parts: int) -> list[int]:
    """`num_parts + 1` boundaries cutting `weights` into contiguous, non-empty parts whose
    sums are as even as possible: the spread (largest part's sum minus smallest's) is
    minimised by dynamic programming over (items placed, parts used), each state keeping
    the spread, largest and smallest sum of its best split; among equal spreads the split
    with the later last cut wins, as in DeepSpeed. Fewer items than parts: `partition_uniform`."""
    count = len(weights)
    if count <= num_parts:
        return partition_uniform(count, num_parts)
    sums = [0.0] + [float(value) for value in prefix_sum_inc(weights)]
    inf = float("inf")
    # best[i][j] = (spread, largest, smallest, last cut) for the first i items in j parts
    best = [[(inf, inf, inf, 0)] * (num_parts + 1) for _ in range(count + 1)]
    best[0][0] = (0.0, -inf, inf, 0)
    for items in range(1, count + 1):
        for parts in range(1, min(items, num_parts) + 1):
            chosen = best[items][parts]
            for cut in range(parts - 1, items):
                spread_before, largest, smallest, _ = best[cut][parts - 1]
                if spread_before == inf:
                    continue
                last = sums[items] - sums[cut]
                high, low = max(largest, last), min(smallest, last)
                if high - low <= chosen[0]:
                    chosen = (high - low, high, low, cut)
            best[items][parts] = chosen
    bounds, items = [count], count
    for parts in range(num_parts, 0, -1):
        items = best[items][parts][3]
        bounds.append(items)
    return bounds[::-1]


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log the accelerator's allocated and peak memory and the host's use, after `message`
    (only with `force=True`, as DeepSpeed: the calls stay in code and cost nothing)."""
    if not force:
        return
    device = ""
    if torch.cuda.is_available():
        gigabyte = 2**30
        device = (f" | device allocated {torch.cuda.memory_allocated() / gigabyte:.2f} GB, "
                  f"peak {torch.cuda.max_memory_allocated() / gigabyte:.2f} GB")
    with open("/proc/self/status") as status:
        resident = next((line.split()[1] for line in status if line.startswith("VmRSS:")), "0")
    log.info("%s%s | host resident %.2f GB", message, device, int(resident) / 2**20)


def move_to_device(item: Any, device: torch.device | str,
                   criterion_func: Callable[[Any], bool] | None = None) -> Any:
    """`item` (a tensor, or lists, tuples and dicts of them) on `device`; an item that
    `criterion_func` accepts is moved in place (its `.data` replaced) and returned itself."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(value, device, criterion_func) for value in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(value, device, criterion_func) for value in item)
    if isinstance(item, dict):
        return {key: move_to_device(value, device, criterion_func) for key, value in item.items()}
    return item.to(device)


def is_model_parallel_parameter(param: torch.Tensor) -> bool:
    """A parameter split over the model-parallel group (Megatron's marks)."""
    return bool(getattr(param, "model_parallel", False) or getattr(param, "tensor_model_parallel", False))


def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2,
                    mpu: Any = None) -> torch.Tensor:
    """Scale the gradients of `parameters` in place so that their `norm_type` norm is at
    most `max_norm`; returns the norm before clipping. With `mpu`, the norm covers the
    model-parallel group's pieces (a replicated parameter counted on its rank 0 only).
    The norm is then averaged over the data-parallel group, as DeepSpeed 0.19.8 does:
    equal to each rank's where gradients are synchronised, a common value where expert
    gradients differ."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [param for param in parameters if param.grad is not None]
    norm_type = float(norm_type)
    if norm_type == math.inf:
        total = torch.stack([param.grad.detach().abs().max().float() for param in parameters]).max()
        if mpu is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=mpu.get_model_parallel_group())
    else:
        norms = [param.grad.detach().float().norm(norm_type) for param in parameters
                 if mpu is None or mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(param)]
        total = torch.stack(norms).pow(norm_type).sum().float() if norms else torch.zeros(1)
        if mpu is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
        total = total.pow(1.0 / norm_type)
    if dist.is_available() and dist.is_initialized():
        data_parallel = groups._get_data_parallel_group()
        total = total / float(dist.get_world_size(group=data_parallel))
        dist.all_reduce(total, group=data_parallel)
    if not parameters:
        return total
    total = total.to(parameters[0].device)
    coefficient = torch.clamp(torch.tensor(float(max_norm), device=total.device) / (total + 1e-6), max=1.0)
    for param in parameters:
        param.grad.detach().mul_(coefficient)
    return total


class PartitionedTensor:
    """One rank's piece of a tensor split over a process group: the tensor is flattened and
    cut by `partition_uniform` into `world` contiguous pieces (the first ones one element
    longer when it does not divide), and this rank keeps piece `rank` as `local_data`.

    `to_meta()` encodes the split as a long tensor, DeepSpeed's layout so pieces and meta
    can travel between processes running either library: `[ndim, *shape, num_parts, rank,
    *boundaries]` with the `num_parts + 1` boundaries of `partition_uniform`.
    `from_meta(meta, local_part, group)` rebuilds the object on the receiving side, and
    `full()` gathers every rank's piece back into the whole tensor (a collective: every
    rank of the group calls it)."""

    def __init__(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None):
        self.group = group
        self.num_parts = dist.get_world_size(group=group)
        self.rank = dist.get_rank(group=group)
        self.orig_size = list(tensor.size())
        self.orig_device = tensor.device
        self.partition = partition_uniform(tensor.numel(), self.num_parts)
        start, stop = self.partition[self.rank], self.partition[self.rank + 1]
        self.local_data = tensor.detach().reshape(-1)[start:stop].clone()

    @classmethod
    def from_meta(cls, meta: torch.Tensor, local_part: torch.Tensor, group: dist.ProcessGroup | None = None,
                  device: torch.device | str | None = None) -> PartitionedTensor:
        """The partitioned tensor `meta` (from `to_meta()`) describes, holding `local_part`
        as this rank's piece."""
        if meta.dtype != torch.long:
            raise TypeError(f"PartitionedTensor.from_meta: meta must be a torch.long tensor (from to_meta()), "
                            f"got {meta.dtype}")
        values = meta.tolist()
        ndim = values[0]
        shape, (num_parts, rank), boundaries = values[1:1 + ndim], values[1 + ndim:3 + ndim], values[3 + ndim:]
        world, own_rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        if (num_parts, rank) != (world, own_rank) or len(boundaries) != num_parts + 1:
            raise ValueError(f"PartitionedTensor.from_meta: the meta describes piece {rank} of {num_parts} "
                             f"but this is rank {own_rank} of a group of {world}: rebuild it on the rank, in "
                             f"the group, that made the meta (the pieces are not re-split)")
        part = cls.__new__(cls)
        part.group, part.num_parts, part.rank = group, num_parts, rank
        part.orig_size, part.partition = shape, boundaries
        part.orig_device = torch.device(device) if device is not None else local_part.device
        part.local_data = local_part.detach()
        return part

    def full(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The whole tensor, gathered from every rank's piece (pieces padded to the longest
        so one all-gather moves them)."""
        longest = max(high - low for low, high in zip(self.partition, self.partition[1:]))
        padded = torch.zeros(longest, dtype=self.local_data.dtype, device=self.local_data.device)
        padded[:self.local_data.numel()] = self.local_data
        gathered = torch.empty(longest * self.num_parts, dtype=padded.dtype, device=padded.device)
        dist.all_gather_into_tensor(gathered, padded, group=self.group)
        pieces = [gathered[part * longest:part * longest + high - low]
                  for part, (low, high) in enumerate(zip(self.partition, self.partition[1:]))]
        whole = torch.cat(pieces).view(self.orig_size)
        return whole.to(device if device is not None else self.orig_device)

    def to_meta(self) -> torch.Tensor:
        return torch.tensor([len(self.orig_size), *self.orig_size, self.num_parts, self.rank, *self.partition],
                            dtype=torch.long, device=self.orig_device)

    def data(self) -> torch.Tensor:
        return self.local_data

    def local_size(self) -> torch.Size:
        return self.local_data.size()

    def full_size(self) -> list[int]:
        return self.orig_size
