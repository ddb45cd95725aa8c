"""Megatron sequence parallelism: the parts of each layer outside the tensor region hold
1/N of the sequence (Korthikanti et al., 2022).

Between a row-parallel layer and the next column-parallel one (norms, dropout, residual
adds) every tensor rank would otherwise hold the same full activations. Here the decoder
stack's input is split along the sequence over the tensor group, the row-parallel layers'
all-reduce becomes a reduce-scatter to sequence shards, and the column-parallel layers'
input is all-gathered (layers.py, regions.py: `enter_region` / `leave_region` with
`sequence_parallel`). The bytes moved are those of the two all-reduces they replace, plus
one all-gather per region in backward: the column-parallel layers keep only their input's
sequence shard and gather it again for their weight gradient (tensor/sequence_gather.py),
so the activations of those regions, and those inputs, shrink by N.

The split covers the decoder layers: the first layer's input is cut (backward: all-gather)
and the last layer's output gathered again (backward: this rank's chunk), so what follows
the stack (the final norm, whose output some models reshape with the full sequence
length, and the output layer) runs as under plain tensor parallelism.

Parameters replicated over the tensor group that act inside the split regions (norm
weights, row-parallel biases) now see only this rank's positions, so their gradients are
partial: a gradient hook all-reduces each over the tensor group before it is
accumulated, which keeps them identical on every tensor rank.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.runtime.parallel.sequence.stack import decoder_layers, join_at_exit, split_at_entry
from shardwise.runtime.parallel.tensor.layers import TensorRegion
from shardwise.runtime.parallel.tensor.placement import is_tensor_sharded
from shardwise.runtime.parallel.tensor.plans import TensorPlan
from shardwise.runtime.parallel.tensor.regions import join_sequence, split_sequence


def sequence_region_parameters(model: nn.Module, plan: TensorPlan) -> list[tuple[str, nn.Parameter]]:
    """Replicated parameters of the decoder layers: their gradients come from sequence shards."""
    layers, _ = decoder_layers(model, plan, "Megatron sequence parallelism")
    return [(f"{plan.layers}.{name}", param) for name, param in layers.named_parameters()
            if param.requires_grad and not is_tensor_sharded(param)]


def apply_megatron_sequence_parallel(model: nn.Module, plan: TensorPlan, region: TensorRegion) -> None:
    layers, _ = decoder_layers(model, plan, "Megatron sequence parallelism")
    split_at_entry(layers, lambda hidden: split_sequence(hidden, region.comm))
    join_at_exit(layers, lambda hidden: join_sequence(hidden, region.comm))
    for name, param in sequence_region_parameters(model, plan):
        param.register_hook(_sum_over_tensor_group(region, name))


def _sum_over_tensor_group(region: TensorRegion, name: str):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        summed = grad.clone(memory_format=torch.contiguous_format)
        region.comm.all_reduce(summed, f"gradient of {name} over sequence shards").wait()
        return summed

    return hook
