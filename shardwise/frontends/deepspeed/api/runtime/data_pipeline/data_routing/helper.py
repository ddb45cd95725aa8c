"""`deepspeed.runtime.data_pipeline.data_routing.helper`: wrap a model's layers for random-LTD
and save its weights under the unwrapped names, as DeepSpeed 0.19.8's helper does.

    engine, *_ = deepspeed.initialize(model=model, config=config)   # random_ltd enabled
    engine = convert_to_random_ltd(engine, MyLayer)   # every MyLayer wrapped; the engine
                                                      # attaches those random_ltd_layer_id names
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from torch import nn

from shardwise.runtime.data.random_ltd import RandomLayerTokenDrop

WRAPPED = ".random_ltd_layer"  # the wrapper's attribute, in the wrapped layers' parameter names


def convert_to_random_ltd(model: Any, convert_type: type[nn.Module]) -> Any:
    """Wrap every `convert_type` module of `model` (an engine, or any object with
    `.module` and `random_ltd_initialize()`) in RandomLayerTokenDrop, then let the engine
    attach the layers its config names. Layers shardwise's parallelize already wrapped
    (the model family's random-LTD step) are not wrapped twice."""
    root = model.module if hasattr(model, "module") else model
    inside = {id(module.random_ltd_layer) for module in root.modules() if isinstance(module, RandomLayerTokenDrop)}
    targets = [name for name, module in root.named_modules()
               if isinstance(module, convert_type) and id(module) not in inside]
    for name in targets:
        parent, _, child = name.rpartition(".")
        owner = root.get_submodule(parent) if parent else root
        setattr(owner, child, RandomLayerTokenDrop(getattr(owner, child)))
    model.random_ltd_initialize()
    return model


def save_without_random_ltd(model: Any) -> OrderedDict:
    """The model's state dict under the names it has without the wrappers."""
    root = model.module if hasattr(model, "module") else model
    return remove_random_ltd_state_dict(root.state_dict())


def remove_random_ltd_state_dict(state_dict: dict) -> OrderedDict:
    return OrderedDict((key.replace(WRAPPED, ""), value) for key, value in state_dict.items())
