"""A model given as a list of layers, each consuming the previous one's output: the form
DeepSpeed's `PipelineModule` takes, and the simplest model a pipeline can split.

    model = SequentialStages([nn.Conv2d(3, 64, 3), nn.ReLU(), ..., lambda x: x.flatten(1),
                              nn.Linear(4096, 10)], loss_fn=nn.CrossEntropyLoss())

Any callable can be a layer (a function is wrapped in a parameter-free module so the list
stays an `nn.ModuleList`); inputs and outputs of layers are a tensor or a tuple of
tensors, passed to the next layer as one argument. Micro-batches are `(inputs, labels)`
pairs and the last layer's output goes to `loss_fn(output, labels)` (without a
`loss_fn`, the last layer's output is the loss). Unsplit, `forward` runs every layer; with
`pipeline_parallel.size > 1` the pipeline step splits the list like any other model's layers
(split.py) and activations between stages are sent with a header that describes their
shapes, since nothing else fixes them (p2p.py).

`checkpoint_interval` k > 0 recomputes each run of k layers in backward
(`torch.utils.checkpoint`), DeepSpeed's `activation_checkpoint_interval`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardwise.runtime.parallel.pipeline.adapter import Adapter, StageContext


class CallableLayer(nn.Module):
    """A function in the layer list (`lambda x: torch.flatten(x, 1)`), as a module."""

    def __init__(self, function: Callable[..., Any]):
        super().__init__()
        self.function = function

    def forward(self, value: Any) -> Any:
        return self.function(value)


class SequentialStages(nn.Module):
    def __init__(self, layers: Iterable[Callable[..., Any]], loss_fn: Callable[..., torch.Tensor] | None = None,
                 checkpoint_interval: int = 0):
        super().__init__()
        self.layers = nn.ModuleList(layer if isinstance(layer, nn.Module) else CallableLayer(layer) for layer in layers)
        self.loss_fn = loss_fn
        self.checkpoint_interval = checkpoint_interval

    def forward(self, inputs: Any) -> Any:
        """Every layer in order (the unsplit model, e.g. for evaluation at pipeline size 1)."""
        return run_layers(list(self.layers), inputs, self.checkpoint_interval if self.training else 0)


def run_layers(layers: list[nn.Module], hidden: Any, interval: int) -> Any:
    """`layers` in order; with `interval` k > 0 each run of k layers is recomputed in backward."""
    if interval <= 0 or not torch.is_grad_enabled():
        for layer in layers:
            hidden = layer(hidden)
        return hidden
    for start in range(0, len(layers), interval):
        run = layers[start : start + interval]
        hidden = checkpoint(_run_plain, run, hidden, use_reentrant=False)
    return hidden


def _run_plain(layers: list[nn.Module], hidden: Any) -> Any:
    for layer in layers:
        hidden = layer(hidden)
    return hidden


def _writable(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.clone() if value.is_leaf and value.requires_grad else value
    return tuple(_writable(item) for item in value) if isinstance(value, tuple) else value


class SequentialAdapter(Adapter):
    """Pipeline stages of a `SequentialStages`: no embedding or output layer of its own; the
    first stage reads the inputs, the last applies the loss function."""

    input_name = "inputs"
    layers_path = "layers"
    first_modules = ()
    last_modules = ()
    embedding_path = ""
    head_path = ""

    def hidden_size(self, model: nn.Module) -> int:
        raise TypeError("a SequentialStages model has no fixed hidden size: its layers' outputs are described "
                        "by a header in every message")

    def activation_shape(self, model: nn.Module, context: StageContext) -> None:
        return None

    def embed(self, model: nn.Module, context: StageContext) -> Any:
        return context.kwargs["inputs"]

    def run_layers(self, layers: list[nn.Module], hidden: Any, context: StageContext) -> Any:
        """A received activation is a leaf that takes a gradient: copied first, so a
        layer may work in place on it (`nn.ReLU(inplace=True)` opening a stage)."""
        return run_layers(layers, _writable(hidden), context.extras["checkpoint_interval"])

    def prepare(self, model: nn.Module, context: StageContext, dtype: torch.dtype) -> None:
        context.extras = {"checkpoint_interval": model.checkpoint_interval if model.training else 0}

    def loss(self, model: nn.Module, hidden: Any, context: StageContext,
             loss_fn: Callable[..., torch.Tensor] | None) -> torch.Tensor:
        loss_fn = loss_fn if loss_fn is not None else model.loss_fn
        if loss_fn is None:
            if not torch.is_tensor(hidden) or hidden.numel() != 1:
                raise ValueError("a SequentialStages model without loss_fn must end in a layer that returns the "
                                 "loss (one number); give loss_fn to compute it from the output and the labels")
            return hidden.reshape(())
        return loss_fn(hidden, context.labels)
