"""Hugging Face BERT-style encoders with a masked-LM head (BERT, RoBERTa and others laid out
the same way), found by their module names: `<base>.embeddings.word_embeddings`,
`<base>.encoder.layer` (an nn.ModuleList) whose layers hold `attention.self.{query,key,value}`,
`attention.output.dense`, `intermediate.dense` and `output.dense`, and a head (`cls` or
`lm_head`) ending in a `decoder` linear over the vocabulary, usually tied to the embedding.

    tensor      word embeddings split over the vocabulary; query, key, value
                column-parallel inside one tensor region per attention; the attention's
                output dense row-parallel; intermediate column-parallel, output row-parallel;
                the MLM decoder split over the vocabulary with its logits gathered (the
                model's own loss views them as (-1, vocab_size)), tied rows split alike
    recompute   <base>.encoder.layer; selective keeps every linear layer's output
    pipeline    the layers split; the embeddings on the first stage, the MLM head and its
                loss (cross-entropy over labels, -100 ignored) on the last; the
                bidirectional padding mask on every stage
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.core.plan import ModelPlan
from shardwise.runtime.parallel.pipeline.adapter import Adapter, StageContext

HEADS = ("cls.predictions", "lm_head")


def detect(model: nn.Module) -> ModelPlan | None:
    """The plan of an encoder laid out as above, or None when `model` is not one."""
    config = getattr(model, "config", None)
    base = getattr(config, "model_type", None)
    if base is None or not hasattr(model, base):
        return None
    layers = f"{base}.encoder.layer"
    head = next((path for path in HEADS if _has(model, f"{path}.decoder")), None)
    if head is None or not _has(model, f"{base}.embeddings.word_embeddings") or not _has(model, layers):
        return None
    stack = model.get_submodule(layers)
    names = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
             "intermediate.dense", "output.dense")
    if not (isinstance(stack, nn.ModuleList) and len(stack) and all(
            isinstance(_get(stack[0], name), nn.Linear) for name in names)):
        return None
    return ModelPlan(
        name=f"Hugging Face {base}",
        layers=layers,
        tensor_styles={
            f"{base}.embeddings.word_embeddings": "vocab_embedding",
            f"{layers}.*.attention.self": "region_input",
            f"{layers}.*.attention.self.query": "colwise_in_region",
            f"{layers}.*.attention.self.key": "colwise_in_region",
            f"{layers}.*.attention.self.value": "colwise_in_region",
            f"{layers}.*.attention.output.dense": "rowwise",
            f"{layers}.*.intermediate.dense": "colwise",
            f"{layers}.*.output.dense": "rowwise",
            f"{head}.decoder": "colwise_gather",
        },
        divisible={"attention heads (num_attention_heads)": config.num_attention_heads,
                   "vocabulary (vocab_size)": config.vocab_size,
                   "MLP width (intermediate_size)": config.intermediate_size},
        heads=config.num_attention_heads,
        kv_heads=config.num_attention_heads,
        pipeline=EncoderAdapter(base, head),
    )


def _get(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _has(module: nn.Module, path: str) -> bool:
    return _get(module, path) is not None


class EncoderAdapter(Adapter):
    """Stages of a masked-LM encoder: the padding mask, bidirectional, on every stage."""

    input_name = "input_ids"
    label_name = "labels"

    def __init__(self, base: str, head: str):
        self.base, self.head = base, head
        self.layers_path = f"{base}.encoder.layer"
        self.first_modules = (f"{base}.embeddings",)
        self.last_modules = (head.split(".")[0],)
        self.embedding_path = f"{base}.embeddings.word_embeddings"
        self.head_path = f"{head}.decoder"

    def hidden_size(self, model: nn.Module) -> int:
        return model.config.hidden_size

    def prepare(self, model: nn.Module, context: StageContext, dtype: torch.dtype) -> None:
        from transformers.masking_utils import create_bidirectional_mask

        ids = context.kwargs["input_ids"]
        probe = torch.empty((*ids.shape, self.hidden_size(model)), dtype=dtype, device=ids.device)
        context.extras = {"mask": create_bidirectional_mask(config=model.config, inputs_embeds=probe,
                                                            attention_mask=context.kwargs.get("attention_mask"))}

    def embed(self, model: nn.Module, context: StageContext) -> torch.Tensor:
        kwargs = context.kwargs
        return model.get_submodule(f"{self.base}.embeddings")(
            input_ids=kwargs["input_ids"], token_type_ids=kwargs.get("token_type_ids"),
            position_ids=kwargs.get("position_ids"))

    def layer(self, layer: nn.Module, hidden: torch.Tensor, context: StageContext) -> torch.Tensor:
        output = layer(hidden, attention_mask=context.extras["mask"])
        return output[0] if isinstance(output, tuple) else output

    def loss(self, model: nn.Module, hidden: torch.Tensor, context: StageContext,
             loss_fn: Callable[..., torch.Tensor] | None) -> torch.Tensor:
        logits = model.get_submodule(self.head)(hidden)
        if loss_fn is not None:
            return loss_fn(logits, context.labels)
        labels = context.kwargs.get("labels")
        if labels is None:
            raise ValueError("a masked-LM micro-batch needs `labels` (-100 where no token is predicted), or pass "
                             "(inputs, labels) with a loss_fn")
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
