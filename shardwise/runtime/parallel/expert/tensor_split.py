"""Experts split by the tensor group (DeepSpeed's `MoE(enable_expert_tensor_parallelism=True)`).

Under tensor parallelism the tokens reaching a mixture of experts are the same on every
rank of a tensor group, so the routing is too, and each member of an expert group
receives the same rows as its tensor peers (they sit at the same place in their expert
groups and hold the same experts). Each expert is then split as a Megatron MLP: its first
Linear column-parallel (it enters the tensor region: identity forward, gradient summed
over the group), its second row-parallel (its output summed over the group), so a rank
computes 1/N of every expert's width and every rank gets the whole output, combined by
the gate as one process does.

DeepSpeed drops the duplicate rows per tensor rank before the all-to-all and gathers them
back after (a saving of traffic, the same numbers); shardwise sends every rank's rows.

The second Linear's bias, added after the sum, stays whole on every tensor rank (its
gradient is the same on each; the experts' gradient norm counts it once, training.py).
"""

from __future__ import annotations

from torch import nn

from shardwise.runtime.parallel.expert.layer import MixtureOfExperts
from shardwise.runtime.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, ShardCache, TensorRegion


def split_experts_by_tensor_group(model: nn.Module, region: TensorRegion) -> None:
    """Split every expert of every mixture of `model` built to be split by the tensor group."""
    cache = ShardCache()
    plain = TensorRegion(region.comm)  # rows routed to experts, not a sequence: no sequence split
    for path, layer in model.named_modules():
        if isinstance(layer, MixtureOfExperts) and layer.split_by_tensor_group:
            for index, expert in enumerate(layer.experts.local):
                _split_expert(expert, plain, cache, f"{path}.experts[{index}]")


def _split_expert(expert: nn.Module, region: TensorRegion, cache: ShardCache, where: str) -> None:
    linears = [(name, module) for name, module in expert.named_modules() if isinstance(module, nn.Linear)]
    if len(linears) != 2:
        raise ValueError(f"{where}: enable_expert_tensor_parallelism splits an expert made of two nn.Linear "
                         "layers inside it (the first column-parallel, the second row-parallel, as a Megatron "
                         f"MLP); this expert ({type(expert).__name__}) has {len(linears)}: give an expert such as "
                         "nn.Sequential(nn.Linear(d, f), activation, nn.Linear(f, d))")
    (first_name, first), (second_name, second) = linears
    _replace(expert, first_name, ColumnParallelLinear(first, region, cache))
    _replace(expert, second_name, RowParallelLinear(second, region, cache))


def _replace(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)
