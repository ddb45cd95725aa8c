"""The layout class a config's `sparse_attention` block names, built with its parameters."""

from __future__ import annotations

from dataclasses import dataclass
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
    return SparseLayout.from_section(section)(num_heads)


@dataclass(frozen=True)
class SparseLayout:
    """The `sparse_attention` block's layout class and parameters, built per layer for its
    number of heads (a plain value, so ranks can compare it)."""

    mode: str
    params: tuple[tuple[str, Any], ...]

    @classmethod
    def from_section(cls, section: Any) -> "SparseLayout":
        keys = sorted(SPARSE_ATTENTION_KEYS[section.mode])
        return cls(section.mode, tuple((key, _frozen(getattr(section, key))) for key in keys))

    def __call__(self, num_heads: int) -> SparsityConfig:
        return CLASSES[self.mode](num_heads, **{key: _thawed(value) for key, value in self.params})


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _thawed(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value

