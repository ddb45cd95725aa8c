"""DeepSpeed's mixture-of-experts routing (`deepspeed.moe.sharded_moe`): the gate, the
experts and the layer that dispatches tokens to them and combines their outputs.

The layer is the runtime's (shardwise/runtime/parallel/expert/: gating.py for top-1 and
top-2 gating, capacity and dropping; routing.py for moving tokens by index along the
masks' routes, as DeepSpeed 0.19.8 does; layer.py for the all-to-all over the expert
group); here it takes DeepSpeed's constructor arguments and parameter names
(`gate.wg.weight`, `experts.deepspeed_experts.<i>.*`).

With expert parallelism size P, a rank holds E/P experts; the (E, C, d) buffer goes to
them by all-to-all over the expert group (chunk p to member p) and the outputs come back
the same way. With P = 1 every expert lives on every rank and the exchange is skipped.
"""

from __future__ import annotations

import copy

from torch import nn

from shardwise.runtime.parallel.expert.gating import (
    JITTER_EPSILON,
    Fp32Linear,
    TopKGate,
    capacity,
    gumbel_noise,
    top1_gating,
    top2_gating,
)
from shardwise.runtime.parallel.expert.layer import ExpertList, MixtureOfExperts
from shardwise.runtime.parallel.expert.routing import Routes

__all__ = ["JITTER_EPSILON", "Experts", "Fp32Linear", "MOELayer", "Routes", "TopKGate", "capacity", "gumbel_noise",
           "top1_gating", "top2_gating"]


class Experts(ExpertList):
    """`num_local_experts` copies of `expert` (identical at the start, as DeepSpeed makes
    them), marked as expert parameters (`allreduce = False`, `group_name`)."""

    list_name = "deepspeed_experts"

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None):
        super().__init__(copy.deepcopy(expert) for _ in range(num_local_experts))
        self.num_local_experts = num_local_experts
        for module in self.deepspeed_experts:
            for param in module.parameters():
                param.allreduce = False
                param.group_name = expert_group_name


class MOELayer(MixtureOfExperts):
    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int, num_local_experts: int,
                 split_by_tensor_group: bool = False):
        super().__init__(gate, experts, num_experts=ep_size * num_local_experts, ep_size=ep_size,
                         split_by_tensor_group=split_by_tensor_group)
        self.ep_group_name = ep_group_name
