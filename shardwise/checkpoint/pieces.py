"""What a rank owns, named the way a checkpoint stores it: parameter name + element range
(zero/shard_view.py), and the model's description a loader checks against.

Saving walks the owned ranges and writes the views they carry; loading walks the new
owner's ranges and fills them.
"""

from __future__ import annotations

from typing import Any

import torch


def module_extras(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Frozen parameters and persistent buffers (BatchNorm statistics...): not trained, so
    not partitioned, and whole on every rank. Non-persistent buffers (rotary tables,
    causal masks) are rebuilt by the model and, as in `state_dict()`, not saved."""
    persistent = set(module.state_dict(keep_vars=True))
    extras = [(name, param) for name, param in module.named_parameters() if not param.requires_grad]
    extras += [(name, buffer) for name, buffer in module.named_buffers() if name in persistent]
    return extras


def describe_model(engine: Any) -> dict[str, Any]:
    """Names and shapes the loader checks a model against (stage-3 parameters are empty
    placeholders between forwards, so trained shapes come from the layout)."""
    trained = {slot.name: list(slot.shape) for unit in engine.units for slot in unit.slots}
    module = engine.module
    parameters = [  # dtype: of the stored values (fp32 masters for trained parameters)
        {"name": name, "shape": trained.get(name, list(param.shape)), "trainable": name in trained,
         "dtype": "float32" if name in trained else _dtype_name(param.dtype)}
        for name, param in module.named_parameters()
    ]
    persistent = set(module.state_dict(keep_vars=True))
    buffers = [
        {"name": name, "shape": list(buffer.shape), "dtype": _dtype_name(buffer.dtype)}
        for name, buffer in module.named_buffers()
        if name in persistent
    ]
    canonical = {id(param): name for name, param in module.named_parameters()}
    aliases = {
        name: canonical[id(param)]
        for name, param in module.named_parameters(remove_duplicate=False)
        if canonical[id(param)] != name
    }
    return {"parameters": parameters, "buffers": buffers, "aliases": aliases}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
