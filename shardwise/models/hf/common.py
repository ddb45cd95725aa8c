"""What Hugging Face decoder families share (llama.py, gpt2.py): attention swapped through
transformers' `AttentionInterface` (Ulysses, block-sparse attention), and how a causal LM
runs as pipeline stages (the causal mask and the loss computed as the model does).

transformers is imported only inside these functions: shardwise imports without it.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any, Callable

import torch
from torch import nn

from shardwise.models.core.kernels import layer_sparse_attention
from shardwise.models.core.plan import UlyssesAttention
from shardwise.runtime.data.random_ltd import gather_tokens, kept_mask
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.ops.policy import LayoutFactory
from shardwise.runtime.parallel.pipeline.adapter import Adapter, StageContext
from shardwise.runtime.parallel.sequence.ulysses import ulysses_attention

SPARSE_ATTENTION_NAME = "shardwise_sparse"
_ulysses_names = itertools.count()


def ulysses_for(model: nn.Module) -> UlyssesAttention:
    """Ulysses for a Hugging Face model: an attention function wrapping the model's own
    (eager, sdpa...) is registered with `AttentionInterface` and made the model's, as
    DeepSpeed's UlyssesSPAttentionHF does."""

    def exchange(layers: nn.ModuleList, comm: Communicator) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        current = model.config._attn_implementation or "eager"
        if current == "eager":  # the model's own module-level eager function
            inner = sys.modules[type(model).__module__].eager_attention_forward
        else:
            inner = ALL_ATTENTION_FUNCTIONS[current]
        name = f"shardwise_ulysses_{next(_ulysses_names)}"
        AttentionInterface.register(name, ulysses_attention(inner, comm))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
        model.config._attn_implementation = name

    return exchange


def use_sparse_attention(attention_class: str) -> Callable[[nn.Module, LayoutFactory], None]:
    """Block-sparse attention for a Hugging Face model whose attention modules are of class
    `attention_class`: each gets a `SparseSelfAttention`, which a registered attention
    function runs in place of the dense one."""

    def rewrite(model: nn.Module, layout: LayoutFactory) -> None:
        _register_sparse_attention()
        config = model.config
        for module in model.modules():
            if type(module).__name__ == attention_class:
                module.sparse_attention = layer_sparse_attention(layout(config.num_attention_heads),
                                                                 config.max_position_embeddings)
        config._attn_implementation = SPARSE_ATTENTION_NAME

    return rewrite


def _sparse_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (B, H, T, d) in, (B, T, H, d) out."""
    if dropout > 0:
        raise ValueError("sparse_attention: attention dropout has no block-sparse version; set attention_dropout 0")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    mask = attention_mask[..., : key.shape[-2]] if attention_mask is not None else None
    out = module.sparse_attention(query, key, value, attn_mask=mask, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _register_sparse_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(SPARSE_ATTENTION_NAME, _sparse_attention)
    # sdpa's masks: None when causality alone suffices, else a boolean (batch, 1, T, T) keep-mask.
    ALL_MASK_ATTENTION_FUNCTIONS.register(SPARSE_ATTENTION_NAME, sdpa_mask)


class CausalLMAdapter(Adapter):
    """Pipeline stages of a Hugging Face causal LM: every stage computes the positions and
    the causal mask as the model would (and `extra` ones, like rotary embeddings); the last
    stage applies the final norm, the output layer and `loss_fn` or the model's own
    `loss_function` (which shifts the labels)."""

    input_name = "input_ids"
    label_name = "labels"
    final_norm_path: str

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
            **self.extra(model, probe, position_ids),
        }

    def extra(self, model: nn.Module, probe: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
        """Per-micro-batch inputs of the layers beyond positions and mask."""
        return {}

    def hidden_size(self, model: nn.Module) -> int:
        return model.config.hidden_size

    def loss(self, model: nn.Module, hidden: torch.Tensor, context: StageContext,
             loss_fn: Callable[..., torch.Tensor] | None) -> torch.Tensor:
        logits = model.lm_head(model.get_submodule(self.final_norm_path)(hidden))
        if loss_fn is not None:
            return loss_fn(logits, context.labels)
        labels = context.kwargs.get("labels")
        if labels is None:
            raise ValueError("a Hugging Face micro-batch needs `labels` (or pass (inputs, labels) with a loss_fn)")
        return model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size)


def kept_decoder_inputs(kwargs: dict[str, Any], indices: torch.Tensor, batch_first: bool) -> dict[str, Any]:
    """A Hugging Face decoder layer's inputs for random-LTD's kept tokens ([batch, kept]
    positions): each kept token keeps its own rotary position (`position_embeddings`' cos
    and sin and `position_ids` gathered), and a mask tensor keeps the rows and columns of
    the kept positions. A mask of None stays None: attention is then causal over the kept
    tokens, which keep their order. (DeepSpeed's wrapper passes these inputs whole, which a
    rotary decoder cannot run: its layers would get tables for more positions than tokens.)"""
    if not batch_first:
        raise ValueError("random_ltd.hidden_state_order: Hugging Face decoders run batch first (batch_seq_dim)")
    batch = indices.shape[0]
    inputs = dict(kwargs)
    tables = kwargs.get("position_embeddings")
    if tables is not None:
        inputs["position_embeddings"] = tuple(gather_tokens(table.expand(batch, *table.shape[1:]), indices, True)
                                              for table in tables)
    if kwargs.get("position_ids") is not None:
        inputs["position_ids"] = kwargs["position_ids"].expand(batch, -1).gather(1, indices)
    if isinstance(kwargs.get("attention_mask"), torch.Tensor):
        mask = kwargs["attention_mask"]
        inputs["attention_mask"] = kept_mask(mask.expand(batch, *mask.shape[1:]), indices, "encoder")
    return inputs
