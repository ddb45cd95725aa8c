"""Hugging Face GPT-2: its parallelisms, in one plan.

    tensor      wte and lm_head split over the vocabulary; the fused c_attn (Conv1D layout)
                column-parallel in 3 blocks, attention's width attributes made per-rank;
                c_fc column-parallel; the c_proj layers row-parallel; the loss made
                vocabulary-parallel
    sequence    Ulysses through transformers' attention interface (models/hf.py)
    recompute   transformer.h; selective keeps every linear layer's output
    pipeline    transformer.h split; wte, wpe, drop on the first stage, ln_f, lm_head on the last
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from shardwise.formulas.model_shape import ModelShape
from shardwise.models.core.hf_config import check_divides, optional, require

from shardwise.models.hf.common import CausalLMAdapter, ulysses_for
from shardwise.models.core.steps import apply_plan
from shardwise.models.core.plan import ModelPlan
from shardwise.runtime.parallel.pipeline.adapter import StageContext
from shardwise.runtime.parallel.tensor.layers import ShardCache, TensorRegion


def is_gpt2(model: nn.Module) -> bool:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type == "gpt2" and hasattr(model, "transformer") and hasattr(model, "lm_head")


def plan(model: nn.Module) -> ModelPlan:
    config = model.config
    inner = config.n_inner or 4 * config.n_embd
    return ModelPlan(
        name="Hugging Face gpt2",
        layers="transformer.h",
        final_norm="transformer.ln_f",
        tensor_styles={
            "transformer.wte": "vocab_embedding",
            "transformer.h.*.attn": _per_rank_attention_widths,
            "transformer.h.*.attn.c_attn": "colwise_qkv",
            "transformer.h.*.attn.c_proj": "rowwise",
            "transformer.h.*.mlp.c_fc": "colwise",
            "transformer.h.*.mlp.c_proj": "rowwise",
            "lm_head": "vocab_head",
        },
        divisible={"attention heads (n_head)": config.n_head, "vocabulary (vocab_size)": config.vocab_size,
                   "MLP width (n_inner)": inner},
        heads=config.n_head,
        kv_heads=config.n_head,
        hf_loss=True,
        ulysses=ulysses_for(model),
        ulysses_split_kwargs=("position_embeddings",),
        pipeline=GPT2Adapter(),
    )


def parallelize(model: nn.Module, **options) -> nn.Module:
    """This family's parallelisms (the keyword options of core/steps.py's `apply_plan`)."""
    return apply_plan(model, plan(model), **options)


def _per_rank_attention_widths(module: nn.Module, region: TensorRegion, cache: ShardCache) -> nn.Module:
    """GPT-2's attention computes its head split from these attributes."""
    module.split_size //= region.size
    module.embed_dim //= region.size
    module.num_heads //= region.size
    return module


class GPT2Adapter(CausalLMAdapter):
    layers_path = "transformer.h"
    first_modules = ("transformer.wte", "transformer.wpe", "transformer.drop")
    last_modules = ("transformer.ln_f", "lm_head")
    embedding_path = "transformer.wte"
    head_path = "lm_head"
    final_norm_path = "transformer.ln_f"

    def embed(self, model: nn.Module, context: StageContext) -> torch.Tensor:
        transformer = model.transformer
        hidden = transformer.wte(context.kwargs["input_ids"]) + transformer.wpe(context.extras["position_ids"])
        return transformer.drop(hidden)

    def layer(self, layer: nn.Module, hidden: torch.Tensor, context: StageContext) -> torch.Tensor:
        output = layer(hidden, None, context.extras["mask"], position_ids=context.extras["position_ids"])
        return output[0] if isinstance(output, tuple) else output


# -- the planner's shape --------------------------------------------------------------------
def shape(config: Mapping[str, Any], source: str, where: str) -> ModelShape:
    """Token and position embeddings; per block two LayerNorms (weight and bias), a fused
    QKV projection and an output projection, a two-matrix MLP, all with biases; a final
    LayerNorm; the output head tied to the token embedding unless the config says not (the
    planner's count, from the config alone, equal to `model.parameters()`)."""
    h = require(config, "n_embd", where)
    layers = require(config, "n_layer", where)
    heads = require(config, "n_head", where)
    vocab = require(config, "vocab_size", where)
    positions = require(config, "n_positions", where)
    check_divides(("n_embd", h), ("n_head", heads), "each attention head gets n_embd / n_head dimensions", where)
    inner = optional(config, "n_inner", 4 * h, where)
    tied = bool(config.get("tie_word_embeddings", True))

    attention = (h * 3 * h + 3 * h) + (h * h + h)
    mlp = (h * inner + inner) + (inner * h + h)
    block = attention + mlp + 2 * 2 * h
    embedding = vocab * h
    total = embedding + positions * h + layers * block + 2 * h + (0 if tied else embedding)
    return ModelShape(source, total, h, layers, heads, vocab, inner, max(block, embedding))
