"""`deepspeed.moe.layer.MoE`: DeepSpeed's mixture-of-experts layer (routing in sharded_moe.py).

    self.moe = deepspeed.moe.layer.MoE(hidden_size=84, expert=nn.Linear(84, 84), num_experts=4, k=1)
    x, l_aux, exp_counts = self.moe(x)      # add l_aux (times a coefficient) to the loss

Parameter names are DeepSpeed's (`deepspeed_moe.gate.wg.weight`,
`deepspeed_moe.experts.deepspeed_experts.<i>.*`, and `mlp.*` / `coefficient.*` for the
Residual MoE), so state dicts move between the two.

Provided: top-1 and top-2 gating, capacity and eval capacity factors, `min_capacity`,
token dropping and Random Token Selection, the "Jitter" and "RSample" noisy gates,
`used_token`, Residual MoE (`use_residual`: the dense expert beside the mixture, mixed by
a learned 2-way softmax). Expert parallelism is not: with `ep_size` > 1 each rank would
hold num_experts / ep_size experts and exchange tokens with an all-to-all, and the engine
would reduce expert gradients over a group of its own; this layer refuses it (with
ep_size 1 every rank holds every expert, and their gradients are averaged with the
rest). `use_tutel` (a CUDA kernel library) changes no result and is ignored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.frontends.deepspeed.api.moe.sharded_moe import Experts, MOELayer, TopKGate

__all__ = ["MoE"]


class MoE(nn.Module):
    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True):
        super().__init__()
        if ep_size != 1:
            raise ValueError(f"MoE(ep_size={ep_size}): expert parallelism is not provided by shardwise; with "
                             "ep_size=1 every rank holds all experts and the layer computes the same")
        if enable_expert_tensor_parallelism:
            raise ValueError("MoE(enable_expert_tensor_parallelism=True) is not supported: experts are not split "
                             "by tensor parallelism")
        if noisy_gate_policy not in (None, "None", "Jitter", "RSample"):
            raise ValueError(f"MoE: noisy_gate_policy {noisy_gate_policy!r}; use None, 'Jitter' or 'RSample'")
        if num_experts < 1:
            raise ValueError(f"MoE: num_experts must be >= 1, got {num_experts}")
        policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size, self.num_experts, self.num_local_experts = ep_size, num_experts, num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity, policy,
                        drop_tokens, use_rts, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, Experts(expert, self.num_local_experts, self.expert_group_name),
                                      self.expert_group_name, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's engine calls this to create the expert groups; with ep_size 1 there are none."""

    def forward(self, hidden_states: torch.Tensor,
                used_token: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output, the auxiliary load-balancing loss, tokens routed to each expert)."""
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            mix = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * mix[..., 0:1] + dense * mix[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
