"""Built-in plans: which module of a known architecture gets which style, where its
decoder stack is, and which sizes must divide by the tensor (or sequence) group.

Known architectures: shardwise's GPT, Hugging Face Llama, Mistral, Qwen2 (q/k/v biases)
and GPT-2 (fused c_attn in Conv1D layout). Grouped-query attention needs no special case:
q, k and v are split by heads separately, each rank keeping whole KV heads and the query
heads that use them, as long as the KV heads divide by the group. Tied embeddings stay
tied: embedding and output layer split the same vocabulary rows into one local parameter.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Mapping

from torch import nn

LLAMA_FAMILY = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelPlan:
    """Styles by module-name pattern, plus where the decoder stack and its final norm are
    (sequence parallelism splits the sequence between them) and the sizes that must divide."""

    styles: Mapping[str, str]
    layers: str | None = None  # the ModuleList of decoder layers
    final_norm: str | None = None
    sizes: Mapping[str, int] = field(default_factory=dict)  # "what (config attribute)" -> value
    heads: int | None = None  # attention heads, for Ulysses
    kv_heads: int | None = None
    hf_loss: bool = False  # a Hugging Face model whose loss_function must become vocabulary-parallel


def _gpt(model: nn.Module) -> ModelPlan:
    config = model.config
    styles = {
        "wte": "vocab_embedding",
        "blocks.*.attn": "gpt_attention",
        "blocks.*.mlp.fc": "colwise",
        "blocks.*.mlp.proj": "rowwise",
        "lm_head": "vocab_head",
    }
    sizes = {"attention heads (n_head)": config.n_head, "vocabulary (vocab_size)": config.vocab_size,
             "MLP width (4 * n_embd)": 4 * config.n_embd}
    return ModelPlan(styles, "blocks", "ln_f", sizes, config.n_head, config.n_head)


def _llama(model: nn.Module) -> ModelPlan:
    config = model.config
    styles = {
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
    }
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    sizes = {
        "attention heads (num_attention_heads)": config.num_attention_heads,
        "key/value heads (num_key_value_heads)": kv_heads,
        "vocabulary (vocab_size)": config.vocab_size,
        "MLP width (intermediate_size)": config.intermediate_size,
    }
    return ModelPlan(styles, "model.layers", "model.norm", sizes, config.num_attention_heads, kv_heads, True)


def _gpt2(model: nn.Module) -> ModelPlan:
    config = model.config
    styles = {
        "transformer.wte": "vocab_embedding",
        "transformer.h.*.attn": "gpt2_attention",
        "transformer.h.*.attn.c_attn": "colwise_qkv",
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "lm_head": "vocab_head",
    }
    inner = config.n_inner or 4 * config.n_embd
    sizes = {"attention heads (n_head)": config.n_head, "vocabulary (vocab_size)": config.vocab_size,
             "MLP width (n_inner)": inner}
    return ModelPlan(styles, "transformer.h", "transformer.ln_f", sizes, config.n_head, config.n_head, True)


def builtin_plan(model: nn.Module) -> ModelPlan | None:
    """The plan for a known architecture, or None."""
    from shardwise.models.gpt import GPT

    if isinstance(model, GPT):
        return _gpt(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in LLAMA_FAMILY and hasattr(model, "lm_head") and hasattr(model, "model"):
        return _llama(model)
    if model_type == "gpt2" and hasattr(model, "lm_head") and hasattr(model, "transformer"):
        return _gpt2(model)
    return None


def require_plan(model: nn.Module, user_styles: Mapping[str, str] | None, key: str) -> ModelPlan:
    """The user's styles (`key` names where they came from) or the built-in plan."""
    if user_styles:
        known = builtin_plan(model)
        return ModelPlan(dict(user_styles), known.layers if known else None, known.final_norm if known else None,
                         hf_loss=bool(known and known.hf_loss))
    plan = builtin_plan(model)
    if plan is None:
        raise ValueError(
            f"{key}: shardwise has no tensor-parallel plan for {type(model).__name__} (built in: shardwise GPT, "
            f"Hugging Face {', '.join(LLAMA_FAMILY)} and gpt2); give one as {key} = "
            '{"module.name.pattern": "colwise" | "rowwise" | ...}'
        )
    return plan


def check_divisible(plan: ModelPlan, size: int, key: str) -> None:
    """Every size the plan splits must divide by the group; the error names them all."""
    problems = [f"{what} {value}" for what, value in plan.sizes.items() if value % size]
    if problems:
        raise ValueError(f"{key} {size} must divide the model's {', '.join(problems)}: each rank takes an "
                         f"equal share; choose a {key} that divides them")


def matches(pattern: str, name: str) -> bool:
    """Part-by-part fnmatch: `blocks.*.mlp` matches `blocks.3.mlp`, not `blocks.3.x.mlp`."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names))
