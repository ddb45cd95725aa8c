"""`deepspeed.moe.layer.MoE`: DeepSpeed's mixture-of-experts layer (routing in sharded_moe.py).

    self.moe = deepspeed.moe.layer.MoE(hidden_size=84, expert=nn.Linear(84, 84), num_experts=4, k=1)
    x, l_aux, exp_counts = self.moe(x)      # add l_aux (times a coefficient) to the loss

Parameter names are DeepSpeed's (`deepspeed_moe.gate.wg.weight`,
`deepspeed_moe.experts.deepspeed_experts.<i>.*`, and `mlp.*` / `coefficient.*` for the
Residual MoE), so state dicts move between the two.

Provided: top-1 and top-2 gating, capacity and eval capacity factors, `min_capacity`,
token dropping and Random Token Selection, the "Jitter" and "RSample" noisy gates,
`used_token`, Residual MoE (`use_residual`: the dense expert beside the mixture, mixed by
a learned 2-way softmax), and expert parallelism: with `ep_size` P > 1 each rank holds
num_experts / P experts (`deepspeed_experts.0 .. E/P - 1`, the experts p·E/P.. of member
p of its expert group) and tokens travel to them and back by all-to-all
(shardwise/runtime/parallel/expert/, whose mixture-of-experts layer this wraps under
DeepSpeed's names); the engine gives the layer its expert group and
sums the experts' gradients over the ranks holding the same ones, at every ZeRO stage.
With ep_size 1 every rank holds every expert, and their gradients are averaged with the
rest. `enable_expert_tensor_parallelism=True` under tensor parallelism splits each expert
(two nn.Linear layers) over the tensor group as a Megatron MLP
(runtime/parallel/expert/tensor_split.py): DeepSpeed leaves that to the expert module it
is given (Megatron's ParallelMLP) and only builds its groups for it. `use_tutel` (a CUDA
kernel library) changes no result and is ignored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.frontends.deepspeed.api.moe.sharded_moe import Experts, MOELayer, TopKGate
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.parallel.expert import mark_expert_parameters

__all__ = ["MoE"]


class MoE(nn.Module):
    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True):
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"MoE(num_experts={num_experts}, ep_size={ep_size}): each of the ep_size ranks holds "
                             "num_experts / ep_size experts; use an ep_size that divides num_experts")
        if ep_size > 1 and not drop_tokens:
            raise ValueError(f"MoE(ep_size={ep_size}, drop_tokens=False) is not provided: without dropping, the "
                             "capacity is the fullest expert's count, which would have to agree across the expert "
                             "group before the all-to-all; keep drop_tokens=True or use ep_size=1")
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
                                      self.expert_group_name, ep_size, self.num_local_experts,
                                      split_by_tensor_group=enable_expert_tensor_parallelism)
        mark_expert_parameters(self.deepspeed_moe.experts, ep_size)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def use_expert_groups(self, expert: Communicator) -> None:
        """Give the layer its expert group, as the engine does for the inner layer
        (`deepspeed_moe`, the runtime's expert-parallel layer); DeepSpeed's engine does this
        through `set_deepspeed_parallelism`."""
        self.deepspeed_moe.use_expert_groups(expert)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's engine calls this to create the expert groups; shardwise's engine
        creates them itself (`use_expert_groups`)."""

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
