"""Expert parallelism for Hugging Face MoE blocks whose experts are stacked 3-D tensors
(Mixtral's `experts.gate_up_proj` (E, 2·I, d) and `experts.down_proj` (E, d, I)).

With expert-parallel size P, member p of an expert group (P ranks of a data-parallel
group, runtime/distributed/mesh.py) keeps experts p·E/P .. (p+1)·E/P - 1, sliced from the
stacked tensors along the expert dimension; the router (`mlp.gate`) stays whole on every
rank, so the routing weights, the top-k and the router's auxiliary loss
(`output_router_logits`) are computed exactly as the one-process model computes them,
over every expert's logit. Mixtral drops no token: each (token, choice) pair travels to
the member holding its expert and back (runtime/parallel/expert/dropless.py), where the
outputs are weighted and summed per token as the model does.

The experts' gradients carry the tokens of the whole expert group; the engine sums them
over the expert-data group (runtime/parallel/expert/training.py). Tensor parallelism
splits each kept expert's width afterwards (decoders.py `tensor_parallel_experts`).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.parallel.expert import ExpertPlace, mark_expert_parameters
from shardwise.runtime.parallel.expert.dropless import DroplessRoute
from shardwise.runtime.parallel.tensor import tensor_shard


class ExpertParallelStackedExperts(nn.Module):
    """This rank's E/P experts of a stacked-experts module, under the module's parameter
    names; `forward(hidden_states, top_k_index, top_k_weights)` as the module's."""

    def __init__(self, experts: nn.Module, *, size: int, rank: int):
        super().__init__()
        total = experts.gate_up_proj.shape[0]
        if total % size:
            raise ValueError(f"expert_parallel.autoep_size {size}: {type(experts).__name__} has {total} experts "
                             f"(num_local_experts), which do not split over {size} ranks; use a size that divides "
                             "the number of experts")
        self.num_experts, self.expert_parallel_size, self.rank = total, size, rank
        self.local = total // size
        first = rank * self.local
        with torch.no_grad():  # the same parameter objects, which an optimizer built before may hold
            for name in ("gate_up_proj", "down_proj"):
                param = getattr(experts, name)
                param.data = param.data[first : first + self.local].clone()
                setattr(self, name, param)
        self.act_fn = experts.act_fn
        if hasattr(experts, "intermediate_dim"):  # tensor parallelism divides it
            self.intermediate_dim = experts.intermediate_dim
        self.expert_group: Communicator | None = None
        mark_expert_parameters(self, size)

    # -- runtime/parallel/expert/marking.py's ExpertParallelLayer ----------------------------
    def use_expert_groups(self, expert: Communicator) -> None:
        if expert.size != self.expert_parallel_size or expert.rank != self.rank:
            raise ValueError(f"experts split for member {self.rank} of {self.expert_parallel_size} were given "
                             f"member {expert.rank} of an expert group of {expert.size}")
        self.expert_group = expert

    def global_expert_place(self, name: str) -> ExpertPlace:
        """The stacked tensor is one parameter in the every-expert model, and this rank's
        slice is one range of its elements: experts p·E/P.. from element p·E/P times an
        expert's size on. Checkpoints store the slice there, so a load at another
        expert-parallel size (or with every expert among the dense parameters, ep 1)
        reads its own slice from whichever ranks' pieces hold it. With tensor parallelism
        the slice is the one before the tensor group split it (its placement maps the
        block this rank holds, expert_state.py)."""
        local = self.get_parameter(name)
        shard = tensor_shard(local)
        held = shard.global_shape if shard is not None else tuple(local.shape)
        return ExpertPlace(name, (self.num_experts, *held[1:]), self.rank * math.prod(held))

    # -- the MoE block's experts --------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.expert_group is None:
            raise RuntimeError("expert-parallel experts ran before the engine gave them their expert group "
                               "(shardwise.initialize does)")
        choices = top_k_index.shape[-1]
        order = torch.argsort(top_k_index.reshape(-1), stable=True)  # (token, choice) pairs by expert
        token = order // choices
        route = DroplessRoute(top_k_index.reshape(-1)[order], self.num_experts, self.expert_group)
        received = route.dispatch(hidden_states[token])
        outputs = self._run_local_experts(received, route.local_expert)
        returned = route.combine(outputs)
        weighted = returned * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add(0, token, weighted.to(hidden_states.dtype))

    def _run_local_experts(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Each received row through its expert. An expert with no rows still runs (on none),
        so the combine's input always takes part in autograd and every member of the group
        runs its backward exchange."""
        outputs = rows.new_zeros((rows.shape[0], self.down_proj.shape[1]))
        for index in range(self.local):
            where = (expert == index).nonzero().squeeze(1)
            gate, up = F.linear(rows[where], self.gate_up_proj[index]).chunk(2, dim=-1)
            outputs = outputs.index_copy(0, where, F.linear(self.act_fn(gate) * up, self.down_proj[index]))
        return outputs


def spread_stacked_experts(model: nn.Module, *, path: str, size: int, rank: int) -> None:
    """Replace every module matching `path` ("model.layers.*.mlp.experts") with this rank's
    share of its experts."""
    parent_path, _, name = path.rpartition(".")
    layers_path, _, inner = parent_path.partition(".*.")
    for layer in model.get_submodule(layers_path):
        parent = layer.get_submodule(inner)
        setattr(parent, name, ExpertParallelStackedExperts(getattr(parent, name), size=size, rank=rank))
