"""Measured layer costs for `pipeline_parallel.partition: "time"`.

Parameter counts are a fair proxy for a transformer's matrix products but not for what
the count misses: attention's s² work, the output layer's product with the vocabulary and
its loss, element-wise layers. Here every rank runs one synthetic micro-batch
(`train_micro_batch_size_per_gpu` x `profile_seq_len` random token ids) through the whole
unsplit model, piece by piece, timing each piece's forward and backward (the median of a
few repeats after a warm-up), then every rank takes rank 0's numbers, so all pipelines
split alike however their timings differ. Every random generator (CPU and CUDA) is
restored afterwards, the token ids' draw included, and the gradients dropped, so
training starts exactly as it would have without it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
from torch import nn

from shardwise.runtime.parallel.pipeline.adapter import Adapter, StageContext
from shardwise.runtime.parallel.pipeline.split import LayerCosts
from shardwise.runtime.base.random_state import preserved_rng

REPEATS = 3


def measure_layer_costs(model: nn.Module, adapter: Adapter, micro_batch: int, seq_len: int,
                        dtype: torch.dtype = torch.float32) -> LayerCosts:
    """Microseconds of forward + backward per layer, for the embedding, and for the last
    stage's output layer and loss, on this rank."""
    if adapter.label_name is None:
        raise ValueError("pipeline_parallel.partition 'time' measures layers on synthetic token ids, which this "
                         "model does not take: use partition 'parameters' or 'uniform', or give split_points")
    config = model.config
    positions = (getattr(config, "block_size", None) or getattr(config, "n_positions", None)
                 or getattr(config, "max_position_embeddings", None) or seq_len)
    device = next(model.parameters()).device
    with preserved_rng(device):  # the token ids and dropout masks come from no generator the caller sees
        ids = torch.randint(0, config.vocab_size, (micro_batch, min(seq_len, positions))).to(device)
        context = StageContext({adapter.input_name: ids, adapter.label_name: ids}, None, {})
        adapter.prepare(model, context, dtype)
        hidden = adapter.embed(model, context)
        embed = _time(lambda: adapter.embed(model, context))
        layers = []
        for path in adapter.layer_paths(model):
            layer, inputs = model.get_submodule(path), _detached(hidden, requires_grad=True)
            layers.append(_time(lambda: adapter.layer(layer, inputs, context)))
            hidden = adapter.layer(layer, _detached(hidden), context)
        last_input = _detached(hidden, requires_grad=True)
        head = _time(lambda: adapter.loss(model, last_input, context, None))
    model.zero_grad(set_to_none=True)
    return LayerCosts(layers, embed, head)


def agreed_costs(costs: LayerCosts, world: Any) -> LayerCosts:
    """Rank 0's measurements on every rank (`world`: a Communicator over all ranks)."""
    if world is None or world.size == 1:
        return costs
    return world.control_all_gather_object(costs)[0]


def _detached(hidden: Any, requires_grad: bool = False) -> Any:
    """A layer's input cut from the graph before it: a tensor, or a tuple of them (an
    encoder-decoder's), floating ones taking a gradient with `requires_grad`."""
    if isinstance(hidden, tuple):
        return tuple(_detached(tensor, requires_grad) for tensor in hidden)
    return hidden.detach().requires_grad_(requires_grad and hidden.is_floating_point())


def _time(forward: Callable[[], Any]) -> int:
    """Median microseconds of forward + backward (of every output that has a graph) after
    one warm-up run."""
    samples = []
    for repeat in range(REPEATS + 1):
        started = time.perf_counter()
        outputs = forward()
        outputs = [tensor for tensor in (outputs if isinstance(outputs, tuple) else (outputs,)) if tensor.requires_grad]
        torch.stack([tensor.float().sum() for tensor in outputs]).sum().backward()
        if outputs[0].is_cuda:
            torch.cuda.synchronize(outputs[0].device)
        if repeat:
            samples.append(time.perf_counter() - started)
    return max(1, round(statistics.median(samples) * 1e6))
