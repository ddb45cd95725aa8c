"""`deepspeed.runtime.data_pipeline.data_sampling.data_sampler`: DeepSpeedDataSampler with
DeepSpeed's constructor, for scripts that build the curriculum sampler themselves (a
Megatron-style loader); it is shardwise's DifficultySampler (runtime/data/difficulty_sampler.py)
reading the `data_efficiency` block a script passes, as DeepSpeed's config module returns it."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardwise.frontends.deepspeed.config.data_efficiency import DataEfficiencyConfig, data_sampling_policy
from shardwise.runtime.data.difficulty_sampler import DifficultySampler

__all__ = ["DeepSpeedDataSampler"]


class _ProcessGroup:
    """A torch.distributed data-parallel group as the sampler's replica group. Batches are
    summed on the group's device (NCCL takes device tensors only)."""

    def __init__(self, group: Any, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def control_all_reduce(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        if self.size > 1:
            on_device = tensor.cuda() if dist.get_backend(self.group) == "nccl" else tensor
            dist.all_reduce(on_device, group=self.group)
            tensor.copy_(on_device)
        return tensor

    def barrier(self, what: str) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)


class DeepSpeedDataSampler(DifficultySampler):
    def __init__(self, data_efficiency_config: dict[str, Any], one_epoch_total_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, data_parallel_group: Any,
                 gradient_accumulation_steps: int, global_rank: int, drop_last: bool = True):
        sampling = data_efficiency_config.get("data_sampling", {})
        block = {"seed": data_efficiency_config.get("seed", 1234),
                 "data_sampling": {key: sampling[key] for key in ("num_epochs", "num_workers", "pin_memory",
                                                                  "curriculum_learning") if key in sampling}}
        policy = data_sampling_policy(DataEfficiencyConfig.model_validate(block))
        if policy is None:
            raise ValueError("DeepSpeedDataSampler draws curriculum batches: its config needs "
                             "data_sampling.curriculum_learning.enabled true with curriculum_metrics")
        super().__init__(policy, samples=one_epoch_total_samples, micro_batch_size=micro_batch_size,
                         gradient_accumulation_steps=gradient_accumulation_steps,
                         replicas=_ProcessGroup(data_parallel_group, data_parallel_rank, data_parallel_size),
                         drop_last=drop_last)
