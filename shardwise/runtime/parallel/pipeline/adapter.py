"""How a model runs as pipeline stages: the `Adapter` a model family gives (shardwise/models/).

A stage cannot call the model's own `forward` (it holds only some layers and receives
hidden states instead of token ids), so each family says where its layer list is, which
modules belong to the first stage (embeddings) and the last (final norm, output layer),
and how one micro-batch goes through those three parts. The layers are one sequence of
modules (`layer_paths`), usually one nn.ModuleList's; what passes between two of them is a
tensor or a tuple of tensors (an encoder-decoder carries the encoder output beside the
decoder's hidden states). Every stage gets the whole
micro-batch (shapes, positions, masks); only the first reads the token ids and only the
last the labels. A list of layers (`SequentialStages`, DeepSpeed's PipelineModule) has an
adapter of its own here (sequential.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


@dataclass
class StageContext:
    """What every stage derives from one micro-batch before running its layers."""

    kwargs: dict[str, Any]  # the model's forward keyword arguments
    labels: torch.Tensor | None  # for `loss_fn` ((inputs, labels) micro-batches)
    extras: dict[str, Any]  # per family: positions, masks


class Adapter(ABC):
    """One model family's pieces (names relative to the model) and its stage forwards."""

    input_name: str
    label_name: str | None = None  # the forward keyword of the labels, for a micro-batch of the model's own loss
    layers_path: str
    first_modules: tuple[str, ...]
    last_modules: tuple[str, ...]
    embedding_path: str
    head_path: str

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return model.get_submodule(self.layers_path)

    def layer_paths(self, model: nn.Module) -> list[str]:
        """Where each layer is in the model, in the order the stages run them: one list
        (`layers_path`) for most families; an encoder-decoder names its two stacks' blocks
        and what runs between them (the encoder's final norm) as one sequence."""
        return [f"{self.layers_path}.{index}" for index in range(len(self.layers(model)))]

    @abstractmethod
    def hidden_size(self, model: nn.Module) -> int:
        """Width of the hidden states sent between stages."""

    def prepare(self, model: nn.Module, context: StageContext, dtype: torch.dtype) -> None:
        """Fill `context.extras` for this micro-batch (once per forward per stage)."""

    @abstractmethod
    def embed(self, model: nn.Module, context: StageContext) -> torch.Tensor:
        """The first stage: token ids -> hidden states."""

    def activation_shape(self, model: nn.Module, context: StageContext) -> tuple[int, ...] | None:
        """Shape of the hidden states between stages ((batch, sequence, hidden) for the
        transformer families); None: sent with a header describing them."""
        return (*context.kwargs[self.input_name].shape, self.hidden_size(model))

    def layer(self, layer: nn.Module, hidden: torch.Tensor, context: StageContext) -> torch.Tensor:
        return layer(hidden)

    def run_layers(self, layers: list[nn.Module], hidden: Any, context: StageContext) -> Any:
        """One chunk of this stage's layers, in order."""
        for layer in layers:
            hidden = self.layer(layer, hidden, context)
        return hidden

    @abstractmethod
    def loss(self, model: nn.Module, hidden: torch.Tensor, context: StageContext,
             loss_fn: Callable[..., torch.Tensor] | None) -> torch.Tensor:
        """The last stage: hidden states -> the micro-batch's loss."""
