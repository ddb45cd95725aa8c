"""Hugging Face Falcon causal LMs (and models laid out the same way), found by their module
names: `transformer.word_embeddings`, `transformer.h` (an nn.ModuleList) whose layers hold
`self_attention.query_key_value` / `self_attention.dense` and `mlp.dense_h_to_4h` /
`mlp.dense_4h_to_h`, `transformer.ln_f` and `lm_head` (tied to the embedding by default).

Falcon fuses q, k and v in one `query_key_value` whose rows are laid out by the config:

    new_decoder_architecture   per key/value group: [q x heads/kv_heads, k, v] x kv_heads
    multi_query (the default)  [q x heads, k, v]: one key/value head for all query heads
    neither                    per head: [q, k, v] x heads

so the split differs from a Llama-style q/k/v:

    tensor      word_embeddings and lm_head split over the vocabulary; query_key_value
                column-parallel in contiguous blocks (whole key/value groups, or whole heads)
                for the grouped and per-head layouts; a multi-query query_key_value stays
                whole on every rank (its one key/value head cannot be split) and each rank
                multiplies only its query heads' rows and the key/value rows, the weight's
                gradient summed over the group; every attention gets this rank's head counts;
                dense and dense_4h_to_h row-parallel, dense_h_to_4h column-parallel
    recompute   transformer.h; selective keeps every linear layer's output
    pipeline    transformer.h split; rotary embeddings and the causal mask on every stage

ALiBi Falcons (Falcon-RW, `alibi=True`) build a bias over all heads in the model's forward,
folded into the mask: tensor and pipeline parallelism refuse them, naming the fix.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.core.plan import ModelPlan
from shardwise.models.hf.common import CausalLMAdapter
from shardwise.models.hf.decoders import sum_gradients_over_group
from shardwise.runtime.parallel.pipeline.adapter import StageContext
from shardwise.runtime.parallel.tensor.layers import ColumnParallelLinear, ShardCache, TensorRegion
from shardwise.runtime.parallel.tensor.regions import enter_region
from shardwise.runtime.parallel.tensor.styles import Style

LAYERS = "transformer.h"
ATTENTION = f"{LAYERS}.*.self_attention"
MLP = f"{LAYERS}.*.mlp"
ALIBI_REFUSED = ("this Falcon uses ALiBi (config.alibi), whose bias the model's forward builds over all heads and "
                 "folds into the mask; shardwise splits rotary Falcons only: use {key} 1 for it")


def detect(model: nn.Module) -> ModelPlan | None:
    """The plan of a Falcon laid out as above, or None when `model` is not one."""
    config = getattr(model, "config", None)
    inner = getattr(model, "transformer", None)
    if config is None or inner is None or not hasattr(model, "lm_head"):
        return None
    layers = getattr(inner, "h", None)
    if not (isinstance(layers, nn.ModuleList) and len(layers) and hasattr(inner, "word_embeddings")
            and hasattr(inner, "ln_f")):
        return None
    attention, mlp = getattr(layers[0], "self_attention", None), getattr(layers[0], "mlp", None)
    if not (_linear(attention, "query_key_value") and _linear(attention, "dense")
            and _linear(mlp, "dense_h_to_4h") and _linear(mlp, "dense_4h_to_h")):
        return None
    heads = config.num_attention_heads
    kv_heads = _kv_heads(config)
    divisible = {"attention heads (num_attention_heads)": heads, "vocabulary (vocab_size)": config.vocab_size,
                 "MLP width (ffn_hidden_size)": mlp.dense_h_to_4h.out_features}
    if kv_heads > 1:
        divisible["key/value heads (num_kv_heads)"] = kv_heads
    return ModelPlan(
        name=f"Hugging Face {config.model_type}",
        layers=LAYERS,
        final_norm="transformer.ln_f",
        tensor_styles={
            "transformer.word_embeddings": "vocab_embedding",
            ATTENTION: falcon_heads,
            f"{ATTENTION}.query_key_value": "colwise" if kv_heads > 1 else multi_query_qkv(heads),
            f"{ATTENTION}.dense": "rowwise",
            f"{MLP}.dense_h_to_4h": "colwise",
            f"{MLP}.dense_4h_to_h": "rowwise",
            "lm_head": "vocab_head",
        },
        divisible=divisible,
        heads=heads,
        kv_heads=kv_heads,
        hf_loss=True,
        pipeline=FalconAdapter(),
    )


def _linear(module: nn.Module | None, name: str) -> bool:
    return isinstance(getattr(module, name, None), nn.Linear)


def _kv_heads(config: Any) -> int:
    """Key/value heads as the attention lays them out: one for multi-query, else the config's."""
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


# -- styles ---------------------------------------------------------------------------------
def falcon_heads(module: nn.Module, region: TensorRegion, cache: ShardCache) -> nn.Module:
    """The attention reshapes its fused output by its head counts: this rank's share."""
    config = module.config
    if config.alibi:
        raise ValueError("tensor_parallel.size > 1: " + ALIBI_REFUSED.format(key="tensor_parallel.size"))
    module.num_heads //= region.size
    if module.num_kv_heads > 1:  # a multi-query attention's one key/value head is every rank's
        module.num_kv_heads //= region.size
    return module


class MultiQueryParallelLinear(nn.Module):
    """Falcon's multi-query `query_key_value` ([q of every head, k, v]) on one rank of the
    tensor group: the weight stays whole (a parameter half split and half replicated has no
    shard layout), each rank multiplies this rank's query rows and the shared key/value rows,
    and the weight's gradient, a part per rank, is summed over the group."""

    def __init__(self, module: nn.Linear, region: TensorRegion, heads: int):
        super().__init__()
        self.region = region
        self.weight, self.bias = module.weight, module.bias
        head_dim = module.out_features // (heads + 2)
        local = heads // region.size * head_dim
        rows = torch.cat([torch.arange(region.rank * local, (region.rank + 1) * local),
                          torch.arange(heads * head_dim, (heads + 2) * head_dim)])
        self.register_buffer("rows", rows, persistent=False)
        sum_gradients_over_group(self, region)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_region(x, self.region.comm, self.region.sequence_parallel)
        bias = self.bias[self.rows] if self.bias is not None else None
        return F.linear(x, self.weight[self.rows], bias)

    def extra_repr(self) -> str:
        return f"{self.rows.numel()} of {self.weight.shape[0]} rows, tensor group of {self.region.size}"


def multi_query_qkv(heads: int) -> Style:
    def split(module: nn.Module, region: TensorRegion, cache: ShardCache) -> nn.Module:
        return MultiQueryParallelLinear(module, region, heads)

    return split


# -- pipeline stages ------------------------------------------------------------------------
class FalconAdapter(CausalLMAdapter):
    """Stages of a rotary Falcon: rotary embeddings and the causal mask on every stage."""

    layers_path = LAYERS
    first_modules = ("transformer.word_embeddings",)
    last_modules = ("transformer.ln_f", "lm_head")
    embedding_path = "transformer.word_embeddings"
    head_path = "lm_head"
    final_norm_path = "transformer.ln_f"

    def extra(self, model: nn.Module, probe: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
        if model.config.alibi:
            raise ValueError("pipeline_parallel.size > 1: " + ALIBI_REFUSED.format(key="pipeline_parallel.size"))
        return {"embeddings": model.transformer.rotary_emb(probe, position_ids=position_ids)}

    def embed(self, model: nn.Module, context: StageContext) -> torch.Tensor:
        return model.transformer.word_embeddings(context.kwargs["input_ids"])

    def layer(self, layer: nn.Module, hidden: torch.Tensor, context: StageContext) -> torch.Tensor:
        extras = context.extras
        output = layer(hidden, alibi=None, attention_mask=extras["mask"], position_ids=extras["position_ids"],
                       position_embeddings=extras["embeddings"])
        return output[0] if isinstance(output, tuple) else output
