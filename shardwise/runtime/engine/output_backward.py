"""Backward started by the script on what the engine's forward returned: `loss.backward()`
(or `engine.scale(loss).backward()` with fp16 loss scaling) runs as `engine.backward(loss)`.

Plain PyTorch and FSDP2 loops call `loss.backward()` themselves, and DeepSpeed 0.19.8
accepts it at ZeRO 1-3. The engine cannot wrap a call it does not make, so it follows the
backward from both ends, as FSDP does:

- the forward's output tensors get a gradient hook: the first to run in a backward opens
  the engine's pass (ZeRO's reducer told where the window is, the step check told a
  micro-batch ran) and queues a callback on autograd's engine, which closes the pass once
  the whole graph has run (the reductions launched during backward complete, ZeRO-3's
  gathered parameters are freed);
- the trained parameters get a gradient hook that divides each incoming gradient by the
  accumulation count, before autograd adds it to `.grad`, while such a pass is open:
  `engine.backward` divides the loss instead. Dividing at the parameters, not at the
  outputs, leaves a loss a model computed from its own logits (a Hugging Face model's)
  divided once, whichever of its outputs the script's loss starts from.

A gradient that reaches the outputs while any engine's `engine.backward` runs belongs to
that call (a GAN's generator loss flowing through the discriminator's engine): it opens
nothing here, and lands in `.grad` as a foreign gradient (zero/gradients.py). Neither does
`torch.autograd.grad` (a gradient penalty's gradient of the outputs by the inputs), which
adds to no parameter's `.grad`: a pass opens only where autograd will run a trained
parameter's gradient accumulator. A backward that raises half-way never reaches its
callback: the engine's next forward, backward or step finds the pass still open and drops
it as a failed `engine.backward` is dropped.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

_engine_backwards_running = 0  # engine.backward calls in progress, in any engine of this process
_CAN_ASK_AUTOGRAD = hasattr(torch.autograd.graph, "_get_grad_fn_or_grad_acc") and hasattr(
    torch._C, "_will_engine_execute_node")
if _CAN_ASK_AUTOGRAD:
    from torch.autograd.graph import _get_grad_fn_or_grad_acc


class EngineBackward:
    """Marks an `engine.backward` call in progress (a context manager), so that output
    hooks of every engine let its gradients through."""

    def __enter__(self) -> None:
        global _engine_backwards_running
        _engine_backwards_running += 1

    def __exit__(self, *exc: object) -> None:
        global _engine_backwards_running
        _engine_backwards_running -= 1


class OutputBackward:
    """One engine's side of backwards the script starts: `attach(output)` after each
    training forward; `open` while such a backward runs."""

    def __init__(self, *, on_open: Callable[[torch.Tensor], None], on_close: Callable[[], None],
                 divisor: Callable[[], int]):
        """`on_open(gradient)`: the engine opens its pass (given the first output gradient,
        for the step check); `on_close()`: it closes it; `divisor()`: what gradients are
        divided by (the accumulation count)."""
        self._on_open, self._on_close, self._divisor = on_open, on_close, divisor
        self.open = False
        self._params: list[nn.Parameter] = []
        self._handles: list[Any] = []

    def watch_parameters(self, params: list[nn.Parameter]) -> None:
        self._params = params
        self._handles = [param.register_hook(self._divided) for param in params]

    def attach(self, output: Any) -> None:
        """Hooks on the tensors of a forward's output (nested in tuples, lists and dicts: a
        Hugging Face ModelOutput is one)."""
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad and tensor.grad_fn is not None:
                tensor.register_hook(self._on_output_gradient)

    def _on_output_gradient(self, gradient: torch.Tensor) -> None:
        if self.open or _engine_backwards_running or not self._accumulates_into_parameters():
            return
        self._on_open(gradient)
        self.open = True
        torch.autograd.Variable._execution_engine.queue_callback(self._close)

    def _accumulates_into_parameters(self) -> bool:
        """Whether the running backward adds to a trained parameter's `.grad` (autograd's
        private queries, as DeepSpeed uses them; without them, every backward is taken
        for one)."""
        if not _CAN_ASK_AUTOGRAD:
            return True
        for param in self._params:
            with torch.enable_grad():  # the accumulator is made in grad mode; hooks run without it
                node = _get_grad_fn_or_grad_acc(param)
            try:
                if node is not None and torch._C._will_engine_execute_node(node):
                    return True
            except RuntimeError:  # autograd refuses the question inside torch.autograd.grad: no .grad is written
                return False
        return False

    def _close(self) -> None:
        self.open = False
        self._on_close()

    def _divided(self, gradient: torch.Tensor) -> torch.Tensor | None:
        divisor = self._divisor() if self.open else 1
        return gradient / divisor if divisor != 1 else None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

