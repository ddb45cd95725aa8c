"""Hugging Face Llama, Mistral, Qwen2 and Qwen3 causal LMs: their parallelisms, in one plan
(Qwen3's attention normalises q and k per head: its norms are replicated with their
gradients summed over the tensor group; Ulysses is not tested on it and is refused).

    tensor      embed_tokens and lm_head split over the vocabulary; q, k, v (and gate, up)
                column-parallel inside one tensor region per attention (per MLP), each rank
                keeping whole KV heads and the query heads that use them; o_proj and
                down_proj row-parallel; the loss made vocabulary-parallel; Qwen3's
                per-head q_norm, k_norm as decoders.py's per_head_norm
    sequence    Ulysses through transformers' attention interface (models/hf.py); the
                rotary `position_embeddings` every layer gets are cut to its positions
    recompute   model.layers; selective keeps every linear layer's output
    kernels     Llama only: fused RMSNorm and SwiGLU; block-sparse attention
    pipeline    model.layers split; rotary embeddings and the causal mask on every stage
    random-LTD  the chosen model.layers on the kept tokens, rotary tables and mask cut to them
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from shardwise.formulas.model_shape import ModelShape
from shardwise.models.core.hf_config import check_divides, optional, require

from shardwise.models.hf.common import CausalLMAdapter, kept_decoder_inputs, ulysses_for, use_sparse_attention
from shardwise.models.hf.decoders import per_head_norm
from shardwise.models.core.kernels import replace_module
from shardwise.models.core.steps import apply_plan
from shardwise.models.core.plan import ModelPlan
from shardwise.runtime.ops.activations import swiglu
from shardwise.runtime.ops.norms import FusedRMSNorm
from shardwise.runtime.parallel.pipeline.adapter import StageContext

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ULYSSES = ("llama", "mistral", "qwen2")  # sequence parallelism
PER_HEAD_NORMS = ("qwen3",)  # q_norm, k_norm over each head


def is_llama_family(model: nn.Module) -> bool:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type in MODEL_TYPES and hasattr(model, "model") and hasattr(model, "lm_head")


def plan(model: nn.Module) -> ModelPlan:
    config = model.config
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    llama = config.model_type == "llama"  # the fused kernels replace Llama's own module classes
    norms = dict.fromkeys(("model.layers.*.self_attn.q_norm", "model.layers.*.self_attn.k_norm"), per_head_norm)
    return ModelPlan(
        name=f"Hugging Face {config.model_type}",
        layers="model.layers",
        final_norm="model.norm",
        tensor_styles={
            "model.embed_tokens": "vocab_embedding",
            "model.layers.*.self_attn": "region_input",
            "model.layers.*.self_attn.q_proj": "colwise_in_region",
            "model.layers.*.self_attn.k_proj": "colwise_in_region",
            "model.layers.*.self_attn.v_proj": "colwise_in_region",
            "model.layers.*.self_attn.o_proj": "rowwise",
            "model.layers.*.mlp": "region_input",
            "model.layers.*.mlp.gate_proj": "colwise_in_region",
            "model.layers.*.mlp.up_proj": "colwise_in_region",
            "model.layers.*.mlp.down_proj": "rowwise",
            "lm_head": "vocab_head",
            **(norms if config.model_type in PER_HEAD_NORMS else {}),
        },
        divisible={
            "attention heads (num_attention_heads)": config.num_attention_heads,
            "key/value heads (num_key_value_heads)": kv_heads,
            "vocabulary (vocab_size)": config.vocab_size,
            "MLP width (intermediate_size)": config.intermediate_size,
        },
        heads=config.num_attention_heads,
        kv_heads=kv_heads,
        hf_loss=True,
        ulysses=ulysses_for(model) if config.model_type in ULYSSES else None,
        ulysses_split_kwargs=("position_embeddings",),
        pipeline=LlamaAdapter(),
        fused_ops=use_fused_ops if llama else None,
        sparse_attention=use_sparse_attention("LlamaAttention") if llama else None,
        token_drop_inputs=kept_decoder_inputs,
    )


def parallelize(model: nn.Module, **options) -> nn.Module:
    """This family's parallelisms (the keyword options of core/steps.py's `apply_plan`)."""
    return apply_plan(model, plan(model), **options)


class FusedSwiGLUMLP(nn.Module):
    """Llama's MLP, `down(silu(gate(x)) * up(x))`, with the gated unit fused."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def use_fused_ops(model: nn.Module) -> None:
    """LlamaRMSNorm -> FusedRMSNorm, LlamaMLP -> fused SwiGLU (same parameters); the loss is
    transformers' own, from full logits."""
    if model.config.hidden_act != "silu":
        raise ValueError(f"compile.fused_ops: the fused SwiGLU needs hidden_act 'silu', not {model.config.hidden_act!r}")
    for name, module in list(model.named_modules()):
        if type(module).__name__ == "LlamaRMSNorm":
            norm = FusedRMSNorm(module.weight.shape[0], module.variance_epsilon)
            norm.weight = module.weight
            replace_module(model, name, norm)
        elif type(module).__name__ == "LlamaMLP":
            replace_module(model, name, FusedSwiGLUMLP(module.gate_proj, module.up_proj, module.down_proj))


class LlamaAdapter(CausalLMAdapter):
    layers_path = "model.layers"
    first_modules = ("model.embed_tokens",)
    last_modules = ("model.norm", "lm_head")
    embedding_path = "model.embed_tokens"
    head_path = "lm_head"
    final_norm_path = "model.norm"

    def extra(self, model: nn.Module, probe: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
        return {"embeddings": model.model.rotary_emb(probe, position_ids=position_ids)}

    def embed(self, model: nn.Module, context: StageContext) -> torch.Tensor:
        return model.model.embed_tokens(context.kwargs["input_ids"])

    def layer(self, layer: nn.Module, hidden: torch.Tensor, context: StageContext) -> torch.Tensor:
        extras = context.extras
        output = layer(hidden, attention_mask=extras["mask"], position_embeddings=extras["embeddings"],
                       position_ids=extras["position_ids"])
        return output[0] if isinstance(output, tuple) else output


# -- the planner's shape --------------------------------------------------------------------
def shape(config: Mapping[str, Any], source: str, where: str) -> ModelShape:
    """Embedding V·h; per block q/k/v/o projections (k and v narrowed by grouped-query
    attention), a gated MLP of three h×I matrices and two RMSNorm weights; a final norm;
    an untied V·h output head (the planner's count, from the config alone, equal to
    `model.parameters()`). Mistral and the Qwens never have these biases, llama may."""
    h = require(config, "hidden_size", where)
    layers = require(config, "num_hidden_layers", where)
    heads = require(config, "num_attention_heads", where)
    inner = require(config, "intermediate_size", where)
    vocab = require(config, "vocab_size", where)
    kv_heads = optional(config, "num_key_value_heads", heads, where)
    if config.get("head_dim") is None:
        check_divides(("hidden_size", h), ("num_attention_heads", heads),
                       "each attention head gets hidden_size / num_attention_heads dimensions (or set head_dim)", where)
    head_dim = optional(config, "head_dim", h // heads, where)
    if config.get("num_key_value_heads") is not None:
        check_divides(("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                       "grouped-query attention gives each key/value head the same number of query heads", where)
    llama = config["model_type"] == "llama"
    attention_bias = llama and bool(config.get("attention_bias", False))
    mlp_bias = llama and bool(config.get("mlp_bias", False))
    tied = bool(config.get("tie_word_embeddings", False))

    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    attention = h * q_width + 2 * h * kv_width + q_width * h
    if attention_bias:
        attention += q_width + 2 * kv_width + h
    mlp = 3 * h * inner + (2 * inner + h if mlp_bias else 0)
    block = attention + mlp + 2 * h
    embedding = vocab * h
    total = embedding + layers * block + h + (0 if tied else embedding)
    return ModelShape(source, total, h, layers, heads, vocab, inner, max(block, embedding))
