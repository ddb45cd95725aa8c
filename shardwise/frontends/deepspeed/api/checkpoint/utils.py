"""`deepspeed.checkpoint.utils.clone_tensors_for_torch_save`: a copy of a (nested) state
whose tensors own their storage.

`torch.save` writes a tensor's whole storage, so a parameter that is a view into a flat
buffer (ZeRO's, shardwise's gathered units) would save the buffer; a clone saves only its
elements. As DeepSpeed's: tensors are detached and cloned on `device` (or moved there,
which copies), lists, tuples and dicts (of the same dict class) are rebuilt around them,
anything else is returned as it is.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = torch.device("cpu")) -> Any:
    device = torch.device(device)
    if torch.is_tensor(item):
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(value, device) for value in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(value, device) for value in item)
    if isinstance(item, dict):
        return type(item)({key: clone_tensors_for_torch_save(value, device) for key, value in item.items()})
    return item
