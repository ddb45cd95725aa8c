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
    pipeline    refused: a stage boundary inside the decoder must carry the encoder output
                (every decoder block's cross-attention reads it) beside the decoder's hidden
                states, and shardwise's pipeline splits one list of layers; see
                PIPELINE_REFUSED
"""

from __future__ import annotations

from torch import nn

from shardwise.models.core.plan import ModelPlan
from shardwise.runtime.parallel.tensor.layers import ShardCache, TensorRegion

STACKS = ("encoder", "decoder")
PIPELINE_REFUSED = (
    "an encoder-decoder's stages would carry two tensors, the encoder output (which every decoder block's "
    "cross-attention reads) and the decoder's hidden states, through two layer lists (encoder.block, "
    "decoder.block), and shardwise's pipeline splits one list of layers carrying one; use "
    "pipeline_parallel.size 1 for it (tensor parallelism and ZeRO split it), or give a ModelPlan whose "
    "pipeline Adapter runs both stacks"
)


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
        pipeline_refused=PIPELINE_REFUSED,
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
