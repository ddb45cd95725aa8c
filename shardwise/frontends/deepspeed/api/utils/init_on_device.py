"""`deepspeed.OnDevice` (`deepspeed.utils.OnDevice`): build a model's tensors on a given
device in a given floating dtype, as DeepSpeed 0.19.8 does, so a model too large for the
host can be made on the meta device (or straight on a GPU) in 16 bits:

    with deepspeed.OnDevice(dtype=torch.float16, device="meta"):
        model = MyModel()

Inside the block, `torch.empty`, `torch.zeros`, `torch.ones`, `torch.full` and
`torch.Tensor(...)` create their tensors on `device` unless given one, and a floating
tensor is converted to `dtype` (integer tensors keep theirs): DeepSpeed's own way,
replacing those constructors for the block's duration, which is what module
constructors call. `enabled=False` makes the block do nothing.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["OnDevice"]

_CONSTRUCTORS = ("empty", "zeros", "ones", "full")


class OnDevice:
    def __init__(self, dtype: torch.dtype, device: str | torch.device = "meta", enabled: bool = True):
        self.dtype = dtype
        self.device = device
        self.enabled = enabled
        self._saved: dict[str, Callable[..., torch.Tensor]] = {}
        self._saved_new: Any = None

    def _on_device(self, constructor: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def build(*args: Any, **kwargs: Any) -> torch.Tensor:
            if kwargs.get("device") is None:
                kwargs["device"] = self.device
            tensor = constructor(*args, **kwargs)
            return tensor.to(self.dtype) if tensor.is_floating_point() else tensor

        return build

    def _new_tensor(self, empty: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def new(cls: type, *args: Any) -> torch.Tensor:
            tensor = empty(0, device=self.device).new_empty(*args)
            return tensor.to(self.dtype) if tensor.is_floating_point() else tensor

        return new

    def __enter__(self) -> None:
        if not self.enabled:
            return
        self._saved = {name: getattr(torch, name) for name in _CONSTRUCTORS}
        self._saved_new = torch.Tensor.__new__
        torch.Tensor.__new__ = self._new_tensor(self._saved["empty"])
        for name, constructor in self._saved.items():
            setattr(torch, name, self._on_device(constructor))

    def __exit__(self, *exception: Any) -> None:
        if not self.enabled:
            return
        torch.Tensor.__new__ = self._saved_new
        for name, constructor in self._saved.items():
            setattr(torch, name, constructor)
