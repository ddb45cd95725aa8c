"""A mixture-of-experts layer the runtime owns: the router (gating.py), the experts, and
the all-to-all that carries tokens to the ranks holding their experts and back
(exchange.py). Models use it directly (shardwise's GPT, models/gpt/model.py) and front
ends wrap it under their own parameter names (DeepSpeed's `MoE`,
frontends/deepspeed/api/moe/).

A layer holds either every one of its E experts, or the E/P of member p of its expert
group of P ranks (experts p·E/P .. (p+1)·E/P - 1). A model may be built with every
expert and an expert-parallel size P > 1; the expert step of `parallelize`
(`shard_expert_layers`, core/steps.py) then keeps this rank's experts, so the model's
definition is the same at every P and the every-expert model is the reference that the
split one must equal. Either way, checkpoints name each expert by its index in the
every-expert layer (`global_expert_place`), so they move between expert-parallel sizes.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.distributed.mesh import ParallelMesh
from shardwise.runtime.parallel.expert.exchange import exchange_with_experts
from shardwise.runtime.parallel.expert.gating import TopKGate
from shardwise.runtime.parallel.expert.marking import ExpertPlace, mark_expert_parameters
from shardwise.runtime.parallel.expert.routing import Routes
from shardwise.runtime.parallel.tensor.placement import tensor_shard


class ExpertList(nn.Module):
    """The experts this rank holds, in one `nn.ModuleList` under `list_name` (a front end
    names it as its framework does, so that state dicts move between the two)."""

    list_name = "members"

    def __init__(self, experts: Iterable[nn.Module]):
        super().__init__()
        self.add_module(self.list_name, nn.ModuleList(experts))

    @property
    def local(self) -> nn.ModuleList:
        return getattr(self, self.list_name)

    def keep(self, first: int, count: int) -> None:
        """Keep experts first .. first + count - 1 only (the rest live on other ranks)."""
        self.add_module(self.list_name, nn.ModuleList(list(self.local)[first : first + count]))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """(groups, local experts, capacity, d): each expert on its slice of dim 1."""
        outputs = []
        for chunk, expert in zip(inputs.chunk(len(self.local), dim=1), self.local):
            output = expert(chunk)
            outputs.append(output[0] if isinstance(output, tuple) else output)
        return torch.cat(outputs, dim=1)


class MixtureOfExperts(nn.Module):
    """Route each token to its top-k experts, run them, and combine their outputs by the
    gate's weights. `l_aux` (the load-balancing loss) and `exp_counts` (tokens per expert)
    of the last forward are kept for the model to read. An `ExpertParallelLayer`
    (marking.py) once split over its expert group."""

    def __init__(self, gate: TopKGate, experts: ExpertList, *, num_experts: int, ep_size: int = 1,
                 split_by_tensor_group: bool = False):
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"a mixture of {num_experts} experts cannot be split over ep_size {ep_size} ranks: each "
                             "rank holds num_experts / ep_size experts; use an ep_size that divides num_experts")
        if len(experts.local) not in (num_experts, num_experts // ep_size):
            raise ValueError(f"a mixture of {num_experts} experts over ep_size {ep_size} holds either every expert or "
                             f"{num_experts // ep_size} of them, not {len(experts.local)}")
        if ep_size > 1 and not gate.drop_tokens:
            raise ValueError(f"a mixture of experts with ep_size {ep_size} must drop tokens (drop_tokens=True): "
                             "without dropping, the capacity is the fullest expert's count, which would have to agree "
                             "across the expert group before the all-to-all; keep dropping or use ep_size 1")
        self.gate, self.experts = gate, experts
        self.num_experts, self.ep_size = num_experts, ep_size
        self.split_by_tensor_group = split_by_tensor_group  # under tensor parallelism (tensor_split.py)
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None
        self.expert_group: Communicator | None = None  # given by the engine once split

    @property
    def num_local_experts(self) -> int:
        return len(self.experts.local)

    @property
    def expert_parallel_size(self) -> int:
        """P once the experts are split over P ranks; 1 while this layer holds every expert."""
        return self.num_experts // self.num_local_experts

    def keep_experts_of(self, member: int) -> None:
        """Keep member `member`'s E/P experts of the every-expert layer, marked as experts
        split over P ranks (the engine trains them apart: parallel/expert/training.py)."""
        if self.expert_parallel_size != 1:
            raise ValueError("this mixture of experts is split over its expert group already")
        count = self.num_experts // self.ep_size
        self.experts.keep(member * count, count)
        mark_expert_parameters(self.experts, self.ep_size)

    def use_expert_groups(self, expert: Communicator) -> None:
        """Exchange tokens over `expert` (this rank's expert group) from now on."""
        if expert.size != self.ep_size:
            raise ValueError(f"MoE(ep_size={self.ep_size}) was given an expert group of {expert.size} ranks")
        self.expert_group = expert

    def global_expert_place(self, name: str) -> ExpertPlace:
        """`experts.<list>.<i>.*` of member p of the expert group is expert p·E/P + i of the
        every-expert layer, whole (checkpoints store it under that name)."""
        marker = f"experts.{self.experts.list_name}."
        head, found, tail = name.partition(marker)
        if not found or head or self.expert_group is None:
            raise ValueError(f"{name} is not an expert parameter of a mixture of experts given its expert group")
        local, rest = tail.split(".", 1)
        param = self.get_parameter(name)
        shard = tensor_shard(param)  # split by the tensor group: the whole expert's shape (tensor_split.py)
        return ExpertPlace(f"{marker}{self.expert_group.rank * self.num_local_experts + int(local)}.{rest}",
                           shard.global_shape if shard is not None else tuple(param.shape))

    def forward(self, hidden: torch.Tensor, used_token: torch.Tensor | None = None) -> torch.Tensor:
        width = hidden.shape[-1]
        tokens = hidden.reshape(-1, width)
        self.l_aux, combine, dispatch, self.exp_counts = self.gate(tokens, used_token)
        routes = Routes.of(dispatch, combine)
        dispatched = routes.dispatch(tokens)
        parts = self.expert_parallel_size
        if parts > 1:
            if self.expert_group is None:
                raise RuntimeError(f"MoE(ep_size={self.ep_size}) holds 1/{self.ep_size} of the experts and needs its "
                                   "expert group: run it inside the engine (shardwise.initialize / "
                                   "deepspeed.initialize), which gives the layer its group")
            dispatched = exchange_with_experts(dispatched, self.expert_group, "tokens for the experts")
        expert_out = self.experts(dispatched.reshape(parts, self.num_local_experts, -1, width))
        expert_out = expert_out.reshape(self.num_experts, -1, width)
        if parts > 1:
            expert_out = exchange_with_experts(expert_out, self.expert_group, "expert outputs")
        return routes.combine(expert_out).reshape(hidden.shape)


def shard_expert_layers(model: nn.Module, mesh: ParallelMesh) -> None:
    """Split every mixture of `model` built with every expert and an ep_size P > 1 over its
    expert group: each rank keeps its E/P experts (collective: the groups are created in
    module order, alike on every rank)."""
    for layer in model.modules():
        if isinstance(layer, MixtureOfExperts) and layer.ep_size > 1 and layer.expert_parallel_size == 1:
            expert, _ = mesh.expert_handles(layer.ep_size)
            layer.keep_experts_of(expert.rank)
