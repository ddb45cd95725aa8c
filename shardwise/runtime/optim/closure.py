"""The loss of an optimizer's `closure`, evaluated as torch's optimizers do in `step`: with
gradients on (the step itself runs under `torch.no_grad()`), None without a closure."""

from __future__ import annotations

from typing import Callable

import torch


def closure_loss(closure: Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
