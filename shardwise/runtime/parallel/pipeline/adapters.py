"""How each supported model family runs as pipeline stages.

A stage cannot call the model's own `forward` (it holds only some layers and receives
hidden states instead of token ids), so each family says where its layer list is, which
modules belong to the first stage (embeddings) and the last (final norm, output layer),
and how one micro-batch goes through those three parts. Every stage gets the whole
micro-batch (shapes, positions, masks); only the first reads the token ids and only the
last the labels.

    shardwise GPT        blocks; wte, wpe, drop | ln_f, lm_head
    Llama family (HF)    model.layers; model.embed_tokens | model.norm, lm_head;
                         rotary embeddings and the causal mask computed on every stage
    GPT-2 (HF)           transformer.h; transformer.wte, wpe, drop | transformer.ln_f, lm_head
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")


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


class GPTAdapter(Adapter):
    input_name = "idx"
    label_name = "targets"
    layers_path = "blocks"
    first_modules = ("wte", "wpe", "drop")
    last_modules = ("ln_f", "lm_head")
    embedding_path = "wte"
    head_path = "lm_head"

    def hidden_size(self, model: nn.Module) -> int:
        return model.config.n_embd

    def embed(self, model: nn.Module, context: StageContext) -> torch.Tensor:
        idx = context.kwargs["idx"]
        positions = torch.arange(idx.shape[1], device=idx.device)
        return model.drop(model.wte(idx) + model.wpe(positions))

    def loss(self, model: nn.Module, hidden: torch.Tensor, context: StageContext,
             loss_fn: Callable[..., torch.Tensor] | None) -> torch.Tensor:
        hidden = model.ln_f(hidden)
        targets = context.kwargs.get("targets")
        if loss_fn is None and targets is not None and getattr(model.lm_head, "computes_loss", False):
            return model.lm_head(hidden, targets)
        logits = model.lm_head(hidden)
        if loss_fn is not None:
            return loss_fn(logits, context.labels)
        if targets is None:
            raise ValueError("a GPT micro-batch needs `targets` (or pass (inputs, labels) with a loss_fn)")
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


class LlamaAdapter(Adapter):
    input_name = "input_ids"
    label_name = "labels"
    layers_path = "model.layers"
    first_modules = ("model.embed_tokens",)
    last_modules = ("model.norm", "lm_head")
    embedding_path = "model.embed_tokens"
    head_path = "lm_head"

    def hidden_size(self, model: nn.Module) -> int:
        return model.config.hidden_size

    def prepare(self, model: nn.Module, context: StageContext, dtype: torch.dtype) -> None:
        from transformers.masking_utils import create_causal_mask

        ids = context.kwargs["input_ids"]
        position_ids = context.kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        probe = torch.empty((*ids.shape, self.hidden_size(model)), dtype=dtype, device=ids.device)
        context.extras = {
            "position_ids": position_ids,
            "mask": create_causal_mask(config=model.config, inputs_embeds=probe,
                                       attention_mask=context.kwargs.get("attention_mask"),
                                       past_key_values=None, position_ids=position_ids),
            "embeddings": model.model.rotary_emb(probe, position_ids=position_ids),
        }

    def embed(self, model: nn.Module, context: StageContext) -> torch.Tensor:
        return model.model.embed_tokens(context.kwargs["input_ids"])

    def layer(self, layer: nn.Module, hidden: torch.Tensor, context: StageContext) -> torch.Tensor:
        extras = context.extras
        output = layer(hidden, attention_mask=extras["mask"], position_embeddings=extras["embeddings"],
                       position_ids=extras["position_ids"])
        return output[0] if isinstance(output, tuple) else output

    def loss(self, model: nn.Module, hidden: torch.Tensor, context: StageContext,
             loss_fn: Callable[..., torch.Tensor] | None, norm: nn.Module | None = None) -> torch.Tensor:
        """Final norm, output layer, then `loss_fn` or the model's own `loss_function`
        (which shifts the labels); GPT-2 shares it with its own final norm."""
        logits = model.lm_head((norm if norm is not None else model.model.norm)(hidden))
        if loss_fn is not None:
            return loss_fn(logits, context.labels)
        labels = context.kwargs.get("labels")
        if labels is None:
            raise ValueError("a Hugging Face micro-batch needs `labels` (or pass (inputs, labels) with a loss_fn)")
        return model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size)


class GPT2Adapter(Adapter):
    input_name = "input_ids"
    label_name = "labels"
    layers_path = "transformer.h"
    first_modules = ("transformer.wte", "transformer.wpe", "transformer.drop")
    last_modules = ("transformer.ln_f", "lm_head")
    embedding_path = "transformer.wte"
    head_path = "lm_head"

    def hidden_size(self, model: nn.Module) -> int:
        return model.config.n_embd

    def prepare(self, model: nn.Module, context: StageContext, dtype: torch.dtype) -> None:
        from transformers.masking_utils import create_causal_mask

        ids = context.kwargs["input_ids"]
        position_ids = context.kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        probe = torch.empty((*ids.shape, self.hidden_size(model)), dtype=dtype, device=ids.device)
        context.extras = {
            "position_ids": position_ids,
            "mask": create_causal_mask(config=model.config, inputs_embeds=probe,
                                       attention_mask=context.kwargs.get("attention_mask"),
                                       past_key_values=None, position_ids=position_ids),
        }

    def embed(self, model: nn.Module, context: StageContext) -> torch.Tensor:
        transformer = model.transformer
        hidden = transformer.wte(context.kwargs["input_ids"]) + transformer.wpe(context.extras["position_ids"])
        return transformer.drop(hidden)

    def layer(self, layer: nn.Module, hidden: torch.Tensor, context: StageContext) -> torch.Tensor:
        output = layer(hidden, None, context.extras["mask"], position_ids=context.extras["position_ids"])
        return output[0] if isinstance(output, tuple) else output

    def loss(self, model: nn.Module, hidden: torch.Tensor, context: StageContext,
             loss_fn: Callable[..., torch.Tensor] | None) -> torch.Tensor:
        return LlamaAdapter.loss(self, model, hidden, context, loss_fn, norm=model.transformer.ln_f)


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter of `model`'s family; a clear error for others."""
    from shardwise.models import GPT
    from shardwise.runtime.parallel.pipeline.sequential import (
        SequentialAdapter,
        SequentialStages,
    )

    if isinstance(model, GPT):
        return GPTAdapter()
    if isinstance(model, SequentialStages):
        return SequentialAdapter()
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in LLAMA_FAMILY and hasattr(model, "model") and hasattr(model, "lm_head"):
        return LlamaAdapter()
    if model_type == "gpt2" and hasattr(model, "transformer") and hasattr(model, "lm_head"):
        return GPT2Adapter()
    raise ValueError(
        f"pipeline_parallel.size > 1: shardwise does not know how to split {type(model).__name__} into stages "
        f"(supported: shardwise GPT, Hugging Face {', '.join(LLAMA_FAMILY)} and gpt2 causal LMs, and a list of "
        "layers in shardwise.runtime.parallel.pipeline.SequentialStages or DeepSpeed's PipelineModule); use "
        "pipeline_parallel.size 1 for this model"
    )
