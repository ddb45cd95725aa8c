"""shardwise GPT's parallelisms: everything shardwise knows about the model, in one plan.

    tensor      wte and lm_head split over the vocabulary; each block's attention with q,
                k, v split by heads (qkv column-parallel in 3 blocks, proj row-parallel);
                the MLP's fc column-parallel, proj row-parallel
    sequence    Ulysses: the attention module exchanges positions for heads itself
    recompute   the blocks; selective keeps every linear layer's output ("linear_outputs")
    kernels     fused LayerNorm, bias+GeLU, output layer + loss; block-sparse attention
    pipeline    blocks split; wte, wpe, drop on the first stage, ln_f, lm_head on the last
    experts     MoE blocks (config.moe_experts > 0) with moe_ep_size P > 1: each rank keeps
                1/P of every MoE block's experts (core/steps.py's expert step); such a
                model has no tensor, sequence or pipeline plan (the blocks' MLPs are
                mixtures, and each stage would need the load-balancing losses)
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.gpt.attention import ParallelCausalSelfAttention
from shardwise.models.gpt.kernels import use_fused_ops, use_sparse_attention
from shardwise.models.gpt.model import GPT
from shardwise.models.core.steps import apply_plan
from shardwise.models.core.plan import ModelPlan
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.parallel.pipeline.adapter import Adapter, StageContext
from shardwise.runtime.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, ShardCache, TensorRegion


def plan(model: GPT) -> ModelPlan:
    config = model.config
    if config.moe_experts:
        return ModelPlan(name="shardwise GPT with MoE blocks", layers="blocks", final_norm="ln_f",
                         pipeline_refused="its MoE blocks' load-balancing losses join the loss at the end of the "
                                          "model; use pipeline_parallel.size 1 (expert and data parallelism)",
                         fused_ops=use_fused_ops)
    return ModelPlan(
        name="shardwise GPT",
        layers="blocks",
        final_norm="ln_f",
        tensor_styles={
            "wte": "vocab_embedding",
            "blocks.*.attn": _tensor_parallel_attention,
            "blocks.*.mlp.fc": "colwise",
            "blocks.*.mlp.proj": "rowwise",
            "lm_head": "vocab_head",
        },
        divisible={"attention heads (n_head)": config.n_head, "vocabulary (vocab_size)": config.vocab_size,
                   "MLP width (4 * n_embd)": 4 * config.n_embd},
        heads=config.n_head,
        kv_heads=config.n_head,
        ulysses=_ulysses_attention,
        pipeline=GPTAdapter(),
        fused_ops=use_fused_ops,
        sparse_attention=use_sparse_attention,
    )


def parallelize(model: GPT, **options) -> nn.Module:
    """This family's parallelisms (the keyword options of core/steps.py's `apply_plan`)."""
    return apply_plan(model, plan(model), **options)


def _tensor_parallel_attention(module: nn.Module, region: TensorRegion, cache: ShardCache) -> nn.Module:
    qkv = ColumnParallelLinear(module.qkv, region, cache, blocks=3)
    proj = RowParallelLinear(module.proj, region, cache)
    return ParallelCausalSelfAttention.replacing(module, qkv, proj, region.size)


def _ulysses_attention(layers: nn.ModuleList, comm: Communicator) -> None:
    for block in layers:
        if not isinstance(block.attn, ParallelCausalSelfAttention):
            block.attn = ParallelCausalSelfAttention.replacing(block.attn, block.attn.qkv, block.attn.proj, 1)
        block.attn.ulysses = comm


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
