"""Hugging Face T5-style encoder-decoders (T5, T5 v1.1 / mT5 with a gated MLP, and any model
laid out the same way), found by their module names: `shared` (and each stack's
`embed_tokens`, tied to it), `encoder.block` and `decoder.block` (nn.ModuleLists) whose
blocks hold `layer.0.SelfAttention` (and in the decoder `layer.1.EncDecAttention`) with
linear q, k, v, o, then `DenseReluDense` (wi -> wo, or wi_0, wi_1 -> wo), and `lm_head`
(tied to `shared` or not, by the config).

    tensor      the shared embedding (every stack's embed_tokens alike) split over the
                vocabulary; q, k, v column-parallel and o row-parallel in every self- and
                cross-attention (the cross-attention's k and v read the encoder output, so
                each projection enters the tensor region itself), each attention keeping
                this rank's heads; the relative position bias (buckets x heads) split by
                heads, so the bias the first block computes and the later blocks reuse holds
                this rank's heads; wi (wi_0, wi_1) column-parallel, wo row-parallel; lm_head
                split over the vocabulary with its logits gathered (the model's loss views
                them whole)
    recompute   the plan names no stack (a plan has one, this model two): activation
                checkpointing finds the largest, the decoder's blocks; the encoder's are kept
    pipeline    one sequence of layers: the encoder's blocks, its final norm, the
                decoder's blocks (Seq2SeqAdapter). The first stage embeds both the
                encoder's tokens and the decoder's (the labels shifted right), so the
                shared embedding is used there only and a tied lm_head is the tied
                output weight the pipeline already moves (GPT-2's); between stages go
                (encoder hidden states, decoder embeddings, position bias) inside the
                encoder and (encoder output, decoder hidden states, self- and
                cross-attention position biases) inside the decoder: every decoder block's
                cross-attention reads the encoder output, and the gradients of all of
                them flow back to the stage that made them (the encoder; the first
                block's relative position bias table)
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.core.plan import ModelPlan
from shardwise.runtime.parallel.pipeline.adapter import Adapter, StageContext
from shardwise.runtime.parallel.tensor.layers import ShardCache, TensorRegion

STACKS = ("encoder", "decoder")

def detect(model: nn.Module) -> ModelPlan | None:
    """The plan of an encoder-decoder laid out as above, or None when `model` is not one."""
    config = getattr(model, "config", None)
    if config is None or not isinstance(getattr(model, "shared", None), nn.Embedding):
        return None
    if not isinstance(getattr(model, "lm_head", None), nn.Linear):
        return None
    styles: dict[str, object] = {"shared": "vocab_embedding", "lm_head": "colwise_gather"}
    for stack in STACKS:
        blocks = _get(model, f"{stack}.block")
        if not (isinstance(blocks, nn.ModuleList) and len(blocks)):
            return None
        attentions = ["layer.0.SelfAttention"] + (["layer.1.EncDecAttention"] if stack == "decoder" else [])
        mlp = _get(blocks[0], f"layer.{len(attentions)}.DenseReluDense")
        if mlp is None or not all(_linears(_get(blocks[0], path), "q", "k", "v", "o") for path in attentions):
            return None
        if _linears(mlp, "wi", "wo"):
            inputs = ("wi",)
        elif _linears(mlp, "wi_0", "wi_1", "wo"):
            inputs = ("wi_0", "wi_1")
        else:
            return None
        if isinstance(_get(model, f"{stack}.embed_tokens"), nn.Embedding):
            styles[f"{stack}.embed_tokens"] = "vocab_embedding"
        for path in attentions:
            prefix = f"{stack}.block.*.{path}"
            styles.update({prefix: attention_heads, f"{prefix}.q": "colwise", f"{prefix}.k": "colwise",
                           f"{prefix}.v": "colwise", f"{prefix}.o": "rowwise"})
            if isinstance(_get(blocks[0], f"{path}.relative_attention_bias"), nn.Embedding):
                styles[f"{prefix}.relative_attention_bias"] = bias_by_heads
        prefix = f"{stack}.block.*.layer.{len(attentions)}.DenseReluDense"
        styles.update({f"{prefix}.{name}": "colwise" for name in inputs})
        styles[f"{prefix}.wo"] = "rowwise"
    return ModelPlan(
        name=f"Hugging Face {config.model_type}",
        tensor_styles=styles,
        divisible={"attention heads (num_heads)": config.num_heads, "vocabulary (vocab_size)": config.vocab_size,
                   "MLP width (d_ff)": config.d_ff},
        heads=config.num_heads,
        kv_heads=config.num_heads,
        pipeline=Seq2SeqAdapter(),
    )


def _get(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _linears(module: nn.Module | None, *names: str) -> bool:
    return module is not None and all(isinstance(getattr(module, name, None), nn.Linear) for name in names)


def attention_heads(module: nn.Module, region: TensorRegion, cache: ShardCache) -> nn.Module:
    """The attention sizes its zero position bias (blocks past the first of a cross-attention)
    by its head count: this rank's share."""
    module.n_heads //= region.size
    module.inner_dim //= region.size
    return module


def bias_by_heads(module: nn.Module, region: TensorRegion, cache: ShardCache) -> nn.Module:
    """The relative position bias table, (buckets, heads): this rank's heads' columns."""
    module.weight = cache.shard(module.weight, 1, 1, region)
    module.embedding_dim = module.weight.shape[1]
    return module


# -- pipeline stages ------------------------------------------------------------------------
class Seq2SeqAdapter(Adapter):
    """Stages of a T5-style encoder-decoder, run as its own forward runs them: each block
    called as its stack calls it, with the stack's masks (made per micro-batch on every
    stage from the token ids' shapes), and the position biases the first block of each
    stack computes passed on to the blocks after it, across stages too. What passes between
    layers is a tuple of tensors (a stage boundary sends it with a header):

        encoder     (encoder hidden, decoder embeddings[, encoder position bias])
        decoder     (encoder output, decoder hidden[, self-attention bias, cross-attention bias])

    (the biases once the stack's first block has made them)."""

    input_name = "input_ids"
    label_name = "labels"
    first_modules = ("shared", "encoder.embed_tokens", "decoder.embed_tokens")
    last_modules = ("decoder.final_layer_norm", "lm_head")
    embedding_path = "shared"
    head_path = "lm_head"

    def layer_paths(self, model: nn.Module) -> list[str]:
        return ([f"encoder.block.{index}" for index in range(len(model.encoder.block))]
                + ["encoder.final_layer_norm"]
                + [f"decoder.block.{index}" for index in range(len(model.decoder.block))])

    def hidden_size(self, model: nn.Module) -> int:
        return model.config.d_model

    def activation_shape(self, model: nn.Module, context: StageContext) -> None:
        return None  # a tuple whose length and bias shapes depend on where the boundary is

    def prepare(self, model: nn.Module, context: StageContext, dtype: torch.dtype) -> None:
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        kwargs = context.kwargs
        ids = kwargs["input_ids"]
        decoder_ids = kwargs.get("decoder_input_ids")
        if decoder_ids is None:
            if kwargs.get("labels") is None:
                raise ValueError("a T5 micro-batch needs `labels` (the decoder reads them shifted right) or "
                                 "`decoder_input_ids`")
            decoder_ids = model._shift_right(kwargs["labels"])
        width = self.hidden_size(model)
        encoder_probe = torch.empty((*ids.shape, width), dtype=dtype, device=ids.device)
        decoder_probe = torch.empty((*decoder_ids.shape, width), dtype=dtype, device=ids.device)
        encoder_config, decoder_config = model.encoder.config, model.decoder.config
        context.extras = {
            "decoder_input_ids": decoder_ids,
            "encoder_mask": create_bidirectional_mask(config=encoder_config, inputs_embeds=encoder_probe,
                                                      attention_mask=kwargs.get("attention_mask")),
            "decoder_mask": create_causal_mask(config=decoder_config, inputs_embeds=decoder_probe,
                                               attention_mask=kwargs.get("decoder_attention_mask"),
                                               past_key_values=None),
            "cross_mask": create_bidirectional_mask(config=decoder_config, inputs_embeds=decoder_probe,
                                                    attention_mask=kwargs.get("attention_mask"),
                                                    encoder_hidden_states=encoder_probe),
            "encoder_dropout": model.encoder.dropout,
            "decoder_dropout": model.decoder.dropout,
        }

    def embed(self, model: nn.Module, context: StageContext) -> tuple[torch.Tensor, torch.Tensor]:
        encoder_hidden = model.encoder.dropout(model.encoder.embed_tokens(context.kwargs["input_ids"]))
        return encoder_hidden, model.decoder.embed_tokens(context.extras["decoder_input_ids"])

    def layer(self, layer: nn.Module, hidden: tuple[torch.Tensor, ...], context: StageContext
              ) -> tuple[torch.Tensor, ...]:
        extras = context.extras
        if not hasattr(layer, "is_decoder"):  # the encoder's final norm: its output, and the decoder starts
            encoder_hidden, decoder_embeddings, *_ = hidden
            return (extras["encoder_dropout"](layer(encoder_hidden)),
                    extras["decoder_dropout"](decoder_embeddings))
        if not layer.is_decoder:
            encoder_hidden, decoder_embeddings, *bias = hidden
            output, bias, _ = layer(encoder_hidden, extras["encoder_mask"], bias[0] if bias else None)
            return output, decoder_embeddings, bias
        encoder_output, decoder_hidden, *biases = hidden
        self_bias, cross_bias = biases if biases else (None, None)
        output, self_bias, cross_bias = layer(decoder_hidden, extras["decoder_mask"], self_bias, encoder_output,
                                              extras["cross_mask"], cross_bias)
        return encoder_output, output, self_bias, cross_bias

    def loss(self, model: nn.Module, hidden: tuple[torch.Tensor, ...], context: StageContext,
             loss_fn: Callable[..., torch.Tensor] | None) -> torch.Tensor:
        """The decoder's final norm and dropout, the output scaled by d_model^-0.5 when the
        head is tied (as the model does), the logits and T5's loss over every position."""
        output = model.decoder.dropout(model.decoder.final_layer_norm(hidden[1]))
        config = model.config
        if getattr(config, "scale_decoder_outputs", getattr(config, "tie_word_embeddings", False)):
            output = output * (config.d_model ** -0.5)
        logits = model.lm_head(output)
        if loss_fn is not None:
            return loss_fn(logits, context.labels)
        labels = context.kwargs.get("labels")
        if labels is None:
            raise ValueError("a T5 micro-batch needs `labels` (or pass (inputs, labels) with a loss_fn)")
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
