"""How an optimizer's state is taken apart for a checkpoint and put back together.

A checkpoint stores state by parameter name and element range, so it can be read back at
any world size or stage: each rank saves the ranges it owns and loads the ranges it owns
now. A codec turns the state torch keeps for one trained tensor (a flat segment of a
rank's chunk) into that form and back:

    encode(state, numel) -> elements, scalars
        elements: tensors with one value per element of the segment, saved by range and
                  resharded freely (Adam's exp_avg, exp_avg_sq; SGD's momentum_buffer)
        scalars:  everything else (Adam's step), identical for every segment of a param
                  group because they step together; saved once per group
    decode(elements, scalars) -> the state dict torch's load_state_dict takes

Optimizers whose state is not element-wise (block-quantised 8-bit state, factored second
moments) provide a codec that converts to and from element-wise tensors, so the
checkpoint format and resharding stay the same for every optimizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # torch is imported where state is handled, so the registry stays light
    import torch


class StateCodec(Protocol):
    def encode(self, state: dict[str, Any], numel: int) -> tuple[dict[str, "torch.Tensor"], dict[str, Any]]:
        """Split one segment's state into per-element tensors and scalars."""

    def decode(self, elements: dict[str, "torch.Tensor"], scalars: dict[str, Any]) -> dict[str, Any]:
        """The state dict for one segment, from what `encode` produced (possibly resharded)."""

    def state_bytes(self, state: dict[str, Any], numel: int) -> int:
        """Bytes of per-element state held for a segment of `numel` elements."""


class ElementwiseCodec:
    """Torch's element-wise optimizers: state tensors shaped like the segment, plus scalars."""

    def encode(self, state: dict[str, Any], numel: int) -> tuple[dict[str, "torch.Tensor"], dict[str, Any]]:
        elements = {key: value for key, value in state.items() if _is_elementwise(value, numel)}
        scalars = {key: value for key, value in state.items() if key not in elements}
        return elements, scalars

    def decode(self, elements: dict[str, "torch.Tensor"], scalars: dict[str, Any]) -> dict[str, Any]:
        return {**scalars, **elements}

    def state_bytes(self, state: dict[str, Any], numel: int) -> int:
        return sum(value.numel() * value.element_size() for value in state.values() if _is_elementwise(value, numel))


def _is_elementwise(value: Any, numel: int) -> bool:
    import torch

    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == numel
