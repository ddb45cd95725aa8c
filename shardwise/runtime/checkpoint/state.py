"""The small, non-tensor state of a run as JSON: RNG streams, optimizer hyper-parameters
and scalars, the caller's client_state.

JSON rather than pickle so that opening a checkpoint can never execute code. Values that
JSON would silently change are handled explicitly: optimizer tuples (Adam's betas) and
0-dim tensors (Adam's `step`) are tagged so they come back as the same type and dtype;
client_state must already be JSON (non-string keys are rejected, since JSON would turn
them into strings and the caller would get back a different dict).
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch


def check_json(value: Any, where: str = "client_state") -> None:
    """Raise a TypeError naming the first part of `value` that JSON cannot store as is."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            check_json(item, f"{where}[{index}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where} has key {key!r} ({type(key).__name__}); JSON keys must be str")
            check_json(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__name__}, which a checkpoint's JSON cannot store; "
        "convert it (e.g. tensor.tolist()) or save it separately"
    )


# -- optimizer values ------------------------------------------------------------------
def encode_value(value: Any, where: str) -> Any:
    """A JSON form of an optimizer hyper-parameter or scalar state that decodes exactly."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"tuple": [encode_value(item, f"{where}[{index}]") for index, item in enumerate(value)]}
    if isinstance(value, list):
        return [encode_value(item, f"{where}[{index}]") for index, item in enumerate(value)]
    if torch.is_tensor(value) and value.dim() == 0:
        return {"tensor": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {"dict": {key: encode_value(item, f"{where}[{key!r}]") for key, item in value.items()}}
    shape = f" of shape {tuple(value.shape)}" if torch.is_tensor(value) else ""
    raise TypeError(
        f"{where} is a {type(value).__name__}{shape}: checkpoints store per-element optimizer "
        "state (one value per parameter element), 0-dim tensors and plain JSON values"
    )


def describe_optimizer(optimizer: torch.optim.Optimizer, what: str = "param group") -> dict[str, Any]:
    """The meta's record of an optimizer: its class and each param group's settings
    (learning rate, betas...; not the parameters), named `what` in encoding errors."""
    return {
        "class": type(optimizer).__name__,
        "param_groups": [
            {key: encode_value(value, f"{what} {index} {key!r}")
             for key, value in group.items() if key not in ("params", "param_names")}
            for index, group in enumerate(optimizer.param_groups)
        ],
    }


def decode_value(value: Any) -> Any:
    if isinstance(value, list):
        return [decode_value(item) for item in value]
    if isinstance(value, dict):
        if "tuple" in value:
            return tuple(decode_value(item) for item in value["tuple"])
        if "tensor" in value:
            return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]))
        return {key: decode_value(item) for key, item in value["dict"].items()}
    return value


# -- random number generators -------------------------------------------------------------
def capture_rng_state(device: torch.device) -> dict[str, Any]:
    """Every RNG a training step may draw from (dropout, data shuffling, augmentation)."""
    version, internal, gauss = random.getstate()
    name, keys, position, has_gauss, cached = np.random.get_state(legacy=True)
    state = {
        "torch_cpu": _b64(torch.get_rng_state()),
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), position, has_gauss, cached],
    }
    if device.type == "cuda":
        state["torch_cuda"] = _b64(torch.cuda.get_rng_state(device))
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(_unb64(state["torch_cpu"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), position, has_gauss, cached))
    if device.type == "cuda" and "torch_cuda" in state:
        torch.cuda.set_rng_state(_unb64(state["torch_cuda"]), device)


def _b64(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
