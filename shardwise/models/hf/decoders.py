"""Hugging Face decoder-only causal LMs found by their module names, not by family: Gemma,
Gemma 2, Gemma 3 (text), Phi-3, Mixtral and any other model laid out the same way.

A model qualifies when it has `model.embed_tokens`, `model.layers` (an nn.ModuleList),
`model.norm` and `lm_head`, and each layer's `self_attn` and `mlp` are one of the layouts
below; the plan is then built from what the first layer holds:

    attention   q_proj, k_proj, v_proj -> o_proj       (Llama's names: Gemma, Mixtral),
                optionally q_norm, k_norm per head     (Gemma 3)
                qkv_proj -> o_proj                     (fused, Phi-3; fewer kv heads or not)
    MLP         gate_proj, up_proj -> down_proj        (gated)
                gate_up_proj -> down_proj              (fused gated, Phi-3)
                fc1 -> fc2                             (two-matrix)
                gate (router) + experts holding 3-D gate_up_proj / down_proj (Mixtral's MoE)

    tensor      embed_tokens and lm_head split over the vocabulary (a scaled embedding,
                Gemma's, keeps its scale; a head whose logits are soft-capped, Gemma 2 / 3,
                gathers them, since tanh over a vocabulary slice is no slice of the whole);
                q, k, v (gate, up) column-parallel inside one tensor region, each rank
                keeping whole KV heads; a fused projection split per part (q, k, v
                of unequal widths with grouped key/value heads); per-head q/k
                norms replicated, their gradients summed over the group; o_proj and
                down_proj row-parallel; MoE: every expert's intermediate width split
                (Megatron's tensor-parallel experts), the router replicated
    recompute   model.layers; selective keeps every linear layer's output
    pipeline    model.layers split; rotary embeddings and the causal mask (per layer type:
                full or sliding window) on every stage; soft-capped logits as the model does;
                the router's auxiliary loss summed up across the stages (MoE)

    experts     Mixtral's stacked experts spread over the expert-parallel group (experts.py),
                the router replicated; with tensor parallelism too, each kept expert's
                width is split over the tensor group as above
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any, Callable

import torch
from torch import nn

from shardwise.models.core.plan import ModelPlan
from shardwise.models.hf.common import CausalLMAdapter
from shardwise.models.hf.experts import spread_stacked_experts
from shardwise.runtime.parallel.pipeline.adapter import StageContext
from shardwise.runtime.parallel.tensor.layers import (
    ColumnParallelLinear,
    ShardCache,
    TensorRegion,
    VocabParallelEmbedding,
)
from shardwise.runtime.parallel.tensor.regions import enter_region, leave_region
from shardwise.runtime.parallel.tensor.styles import Style

LAYERS = "model.layers"
ATTENTION = f"{LAYERS}.*.self_attn"
MLP = f"{LAYERS}.*.mlp"


def detect(model: nn.Module) -> ModelPlan | None:
    """The plan of a decoder laid out as above, or None when `model` is not one."""
    inner = getattr(model, "model", None)
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "lm_head") or inner is None:
        return None
    layers = getattr(inner, "layers", None)
    if not (isinstance(layers, nn.ModuleList) and len(layers) and hasattr(inner, "embed_tokens")
            and hasattr(inner, "norm") and hasattr(inner, "rotary_emb")):
        return None
    attention = _attention_styles(layers[0], config)
    mlp = _mlp_styles(layers[0])
    if attention is None or mlp is None:
        return None
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    capped = getattr(config, "final_logit_softcapping", None) is not None
    router_loss = bool(getattr(config, "output_router_logits", False))
    styles: dict[str, str | Style] = {
        "model.embed_tokens": scaled_vocab_embedding if hasattr(inner.embed_tokens, "embed_scale") else "vocab_embedding",
        **attention,
        **mlp,
        "lm_head": "colwise_gather" if capped else "vocab_head",
    }
    divisible = {"attention heads (num_attention_heads)": heads, "key/value heads (num_key_value_heads)": kv_heads,
                 "vocabulary (vocab_size)": config.vocab_size}
    if getattr(config, "intermediate_size", None):
        divisible["MLP width (intermediate_size)"] = config.intermediate_size
    return ModelPlan(
        name=f"Hugging Face {config.model_type}",
        layers=LAYERS,
        final_norm="model.norm",
        tensor_styles=styles,
        divisible=divisible,
        heads=heads,
        kv_heads=kv_heads,
        hf_loss=not capped,
        pipeline=RouterLossDecoderAdapter() if router_loss else DecoderAdapter(),
        expert_parallel=(functools.partial(spread_stacked_experts, path=f"{MLP}.experts")
                         if f"{MLP}.experts" in mlp else None),
    )


def _attention_styles(layer: nn.Module, config: Any) -> dict[str, str | Style] | None:
    attention = getattr(layer, "self_attn", None)
    if attention is None or not _linear(attention, "o_proj"):
        return None
    norms = {f"{ATTENTION}.{name}": per_head_norm for name in ("q_norm", "k_norm")
             if any(True for _ in getattr(attention, name, nn.Identity()).parameters())}
    if all(_linear(attention, name) for name in ("q_proj", "k_proj", "v_proj")):
        return {**norms, ATTENTION: "region_input", f"{ATTENTION}.q_proj": "colwise_in_region",
                f"{ATTENTION}.k_proj": "colwise_in_region", f"{ATTENTION}.v_proj": "colwise_in_region",
                f"{ATTENTION}.o_proj": "rowwise"}
    if _linear(attention, "qkv_proj"):
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return {**norms, ATTENTION: per_rank_heads, f"{ATTENTION}.qkv_proj": fused_qkv(heads, kv_heads),
                f"{ATTENTION}.o_proj": "rowwise"}
    return None


def _mlp_styles(layer: nn.Module) -> dict[str, str | Style] | None:
    mlp = getattr(layer, "mlp", None)
    if mlp is None:
        return None
    if all(_linear(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")):
        return {MLP: "region_input", f"{MLP}.gate_proj": "colwise_in_region", f"{MLP}.up_proj": "colwise_in_region",
                f"{MLP}.down_proj": "rowwise"}
    if _linear(mlp, "gate_up_proj") and _linear(mlp, "down_proj"):
        return {f"{MLP}.gate_up_proj": fused_gate_up, f"{MLP}.down_proj": "rowwise"}
    if _linear(mlp, "fc1") and _linear(mlp, "fc2"):
        return {f"{MLP}.fc1": "colwise", f"{MLP}.fc2": "rowwise"}
    experts = getattr(mlp, "experts", None)
    if _stacked_experts(experts) and {name for name, _ in mlp.named_children()} == {"gate", "experts"}:
        return {f"{MLP}.experts": tensor_parallel_experts}
    return None


def _linear(module: nn.Module, name: str) -> bool:
    return isinstance(getattr(module, name, None), nn.Linear)


def _stacked_experts(experts: nn.Module | None) -> bool:
    """Experts stored as (experts, 2 * intermediate, hidden) and (experts, hidden, intermediate)."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and gate_up.shape[1] == 2 * down.shape[2]
            and {name for name, _ in experts.named_parameters()} == {"gate_up_proj", "down_proj"})


# -- styles of modules these families have --------------------------------------------------
class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """Gemma's embedding, which multiplies by sqrt(hidden_size), split over the vocabulary."""

    def __init__(self, module: nn.Embedding, region: TensorRegion, cache: ShardCache):
        super().__init__(module, region, cache)
        self.register_buffer("embed_scale", module.embed_scale, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


def scaled_vocab_embedding(module: nn.Module, region: TensorRegion, cache: ShardCache) -> nn.Module:
    return ScaledVocabParallelEmbedding(module, region, cache)


def per_rank_heads(module: nn.Module, region: TensorRegion, cache: ShardCache) -> nn.Module:
    """An attention that slices its fused projection by the config's head counts (Phi-3)
    gets a config of its own with this rank's counts."""
    config = copy.copy(module.config)
    config.num_attention_heads //= region.size
    config.num_key_value_heads = (config.num_key_value_heads or module.config.num_attention_heads) // region.size
    module.config = config
    module.num_key_value_heads = config.num_key_value_heads
    return module


def per_head_norm(module: nn.Module, region: TensorRegion, cache: ShardCache) -> nn.Module:
    """A norm applied to every head (Gemma 3's q_norm, k_norm) sees only this rank's heads:
    its replicated weight's gradient is summed over the group (Megatron sequence
    parallelism already sums every replicated layer parameter's)."""
    return sum_gradients_over_group(module, region)


def sum_gradients_over_group(module: nn.Module, region: TensorRegion) -> nn.Module:
    """A replicated module each rank applies to its own heads only: every rank's gradient
    is a part of the whole, which is their sum (unless Megatron sequence parallelism, which
    sums every replicated layer parameter's gradient, does it already)."""
    if not region.sequence_parallel:
        for name, param in module.named_parameters():
            param.register_hook(_sum_over_group(region, name))
    return module


def _sum_over_group(region: TensorRegion, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        summed = grad.clone(memory_format=torch.contiguous_format)
        region.comm.all_reduce(summed, f"gradient of the replicated {name} over the tensor group").wait()
        return summed

    return hook


def fused_qkv(heads: int, kv_heads: int) -> Style:
    """q, k and v in one matrix (q's heads x head_dim rows, then k's and v's kv_heads x
    head_dim each), each part split by heads: every rank keeps its query heads and the
    key/value heads they use (grouped-query attention keeps consecutive query heads per
    key/value head, so rank r's q heads go with its kv heads)."""

    def split(module: nn.Module, region: TensorRegion, cache: ShardCache) -> nn.Module:
        if kv_heads % region.size:
            raise ValueError(
                f"tensor_parallel.size {region.size}: this model's fused qkv_proj has {kv_heads} key/value heads "
                f"(num_key_value_heads), which do not split over {region.size} ranks; every rank keeps whole "
                "key/value heads; use a tensor_parallel.size that divides num_key_value_heads")
        head_dim = module.out_features // (heads + 2 * kv_heads)
        parts = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        return ColumnParallelLinear(module, region, cache, blocks=parts)

    return split


def fused_gate_up(module: nn.Module, region: TensorRegion, cache: ShardCache) -> nn.Module:
    """gate and up in one matrix (chunked in two by the MLP): each half split."""
    return ColumnParallelLinear(module, region, cache, blocks=2)


def tensor_parallel_experts(module: nn.Module, region: TensorRegion, cache: ShardCache) -> nn.Module:
    """Every expert's intermediate width split over the group, as Megatron's tensor-parallel
    experts: gate_up_proj by rows (each of gate and up), down_proj by columns, the expert
    output summed over the group. The hidden states and the router's weights enter the
    region (identity forward, all-reduced gradient), so the replicated router gets the
    gradient of every rank's share of the experts."""
    module.gate_up_proj = cache.shard(module.gate_up_proj, 1, 2, region)
    module.down_proj = cache.shard(module.down_proj, 2, 1, region)
    if hasattr(module, "intermediate_dim"):
        module.intermediate_dim //= region.size

    def enter(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        values = _bind(_module, args, kwargs)
        for name in ("hidden_states", "top_k_weights"):
            if name not in values:
                raise TypeError(f"{type(_module).__name__}: no {name} input to enter the tensor region with")
            values[name] = enter_region(values[name], region.comm, False)
        return (), values

    def leave(_module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return leave_region(output, region.comm, False)

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave)
    return module


def _bind(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The forward's arguments by name."""
    return dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)


# -- pipeline stages ------------------------------------------------------------------------
class DecoderAdapter(CausalLMAdapter):
    """Stages of a detected decoder: per micro-batch the mask of every layer type the
    config names (Gemma 2 / 3 alternate full and sliding-window attention; others use one,
    sliding when the config has a window) and the rotary embeddings (per layer type when
    the model's rotary module takes one, Gemma 3's local and global)."""

    layers_path = LAYERS
    first_modules = ("model.embed_tokens",)
    last_modules = ("model.norm", "lm_head")
    embedding_path = "model.embed_tokens"
    head_path = "lm_head"
    final_norm_path = "model.norm"

    def extra(self, model: nn.Module, probe: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
        config = model.config
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("pipeline_parallel: use_bidirectional_attention makes this model an encoder; "
                             "shardwise's decoder stages are causal; use pipeline_parallel.size 1")
        rotary = model.model.rotary_emb
        types = sorted(set(getattr(config, "layer_types", None) or ()))
        if "layer_type" in inspect.signature(rotary.forward).parameters:
            embeddings = {kind: rotary(probe, position_ids, kind) for kind in types}
        else:
            embeddings = dict.fromkeys(types or [None], rotary(probe, position_ids=position_ids))
        return {"embeddings": embeddings, "masks": self._masks(config, probe, position_ids, types)}

    def prepare(self, model: nn.Module, context: StageContext, dtype: torch.dtype) -> None:
        super().prepare(model, context, dtype)
        if context.extras["masks"] is None:  # one mask, the causal one made by CausalLMAdapter
            context.extras["masks"] = {kind: context.extras["mask"] for kind in context.extras["embeddings"]}

    def _masks(self, config: Any, probe: torch.Tensor, position_ids: torch.Tensor,
               types: list[str]) -> dict[str | None, Any] | None:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        makers: dict[str | None, Callable[..., Any]]
        if types:
            makers = {kind: create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
                      for kind in types}
        elif getattr(config, "sliding_window", None) is not None:
            makers = {None: create_sliding_window_causal_mask}
        else:
            return None
        return {kind: make(config=config, inputs_embeds=probe, attention_mask=None, past_key_values=None,
                           position_ids=position_ids) for kind, make in makers.items()}

    def embed(self, model: nn.Module, context: StageContext) -> torch.Tensor:
        return model.model.embed_tokens(context.kwargs["input_ids"])

    def layer(self, layer: nn.Module, hidden: torch.Tensor, context: StageContext) -> torch.Tensor:
        extras = context.extras
        kind = _layer_type(layer, extras["embeddings"])
        output = layer(hidden, attention_mask=extras["masks"][kind], position_embeddings=extras["embeddings"][kind],
                       position_ids=extras["position_ids"])
        return output[0] if isinstance(output, tuple) else output

    def loss(self, model: nn.Module, hidden: torch.Tensor, context: StageContext,
             loss_fn: Callable[..., torch.Tensor] | None) -> torch.Tensor:
        cap = getattr(model.config, "final_logit_softcapping", None)
        if cap is None:
            return super().loss(model, hidden, context, loss_fn)
        logits = torch.tanh(model.lm_head(model.model.norm(hidden)) / cap) * cap
        if loss_fn is not None:
            return loss_fn(logits, context.labels)
        labels = context.kwargs.get("labels")
        if labels is None:
            raise ValueError("a Hugging Face micro-batch needs `labels` (or pass (inputs, labels) with a loss_fn)")
        return model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size)


class RouterLossDecoderAdapter(DecoderAdapter):
    """Stages of an MoE decoder whose loss adds the router's auxiliary loss
    (`output_router_logits`, Mixtral's load-balancing loss). The model computes it over
    every layer's router output together: E · Σ_e (c_e / R) · (p_e / R), with c_e the top-k
    choices of expert e and p_e the sum of its router probabilities over all R = layers x
    tokens rows (padding excluded by the attention mask). Both sums add up layer by layer,
    so the stages carry them beside the hidden states, each adding its layers', and the last
    stage adds the loss; its gradient returns through p to every stage's routers (c is a
    count and takes none)."""

    def activation_shape(self, model: nn.Module, context: StageContext) -> None:
        return None  # (hidden states, c, p)

    def prepare(self, model: nn.Module, context: StageContext, dtype: torch.dtype) -> None:
        super().prepare(model, context, dtype)
        ids = context.kwargs["input_ids"]
        mask = context.kwargs.get("attention_mask")
        context.extras["router_rows"] = (torch.ones(ids.numel(), device=ids.device) if mask is None
                                         else mask.reshape(-1).float())

    def embed(self, model: nn.Module, context: StageContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = super().embed(model, context)
        zeros = torch.zeros(model.config.num_local_experts, dtype=torch.float32, device=hidden.device)
        return hidden, zeros, zeros.clone()

    def layer(self, layer: nn.Module, carried: tuple[torch.Tensor, ...], context: StageContext
              ) -> tuple[torch.Tensor, ...]:
        hidden, choices, probabilities = carried
        logits: list[torch.Tensor] = []
        handle = layer.mlp.gate.register_forward_hook(lambda _module, _args, output: logits.append(output[0]))
        try:
            hidden = super().layer(layer, hidden, context)
        finally:
            handle.remove()
        rows = context.extras["router_rows"]
        top_k = layer.mlp.gate.top_k
        weights = torch.softmax(logits[-1].float(), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
        choices = choices + torch.zeros_like(choices).scatter_add(0, chosen, rows.repeat_interleave(top_k))
        probabilities = probabilities + (weights * rows.unsqueeze(-1)).sum(0)
        return hidden, choices, probabilities

    def loss(self, model: nn.Module, carried: tuple[torch.Tensor, ...], context: StageContext,
             loss_fn: Callable[..., torch.Tensor] | None) -> torch.Tensor:
        hidden, choices, probabilities = carried
        loss = super().loss(model, hidden, context, loss_fn)
        if loss_fn is not None:  # a loss of the caller's over the logits, as the model's forward would give it
            return loss
        config = model.config
        rows = context.extras["router_rows"].sum() * config.num_hidden_layers
        router_loss = torch.sum(choices.detach() / rows * (probabilities / rows)) * config.num_local_experts
        return loss + config.router_aux_loss_coef * router_loss.to(loss.device)


def _layer_type(layer: nn.Module, by_type: dict[str | None, Any]) -> str | None:
    """The layer's attention type (its index in config.layer_types), or None for one type."""
    if list(by_type) == [None]:
        return None
    attention = layer.self_attn
    return attention.config.layer_types[attention.layer_idx]
