"""The layout class a config's `sparse_attention` block names, built with its parameters."""

from __future__ import annotations

from typing import Any

from shardwise.frontends.deepspeed.config.schema import SPARSE_ATTENTION_KEYS
from shardwise.runtime.ops.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

CLASSES: dict[str, type[SparsityConfig]] = {
    "dense": DenseSparsityConfig,
    "fixed": FixedSparsityConfig,
    "variable": VariableSparsityConfig,
    "bigbird": BigBirdSparsityConfig,
    "bslongformer": BSLongformerSparsityConfig,
}

def sparsity_config(section: Any, num_heads: int) -> SparsityConfig:
    """The layout for a validated `sparse_attention` block (a SparseAttentionConfig)."""
    params = {key: getattr(section, key) for key in SPARSE_ATTENTION_KEYS[section.mode]}
    return CLASSES[section.mode](num_heads, **params)
