"""Kernels as a policy: whether a model family's fused operators replace its plain ones
(fused norms, bias+activation, SwiGLU, linear + cross-entropy), and which block-sparse
layout its attention uses (C19, C20). The model family does the replacing (shardwise/models/)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from shardwise.runtime.ops.sparse_attention import SparsityConfig

LayoutFactory = Callable[[int], SparsityConfig]  # number of attention heads -> layout


@dataclass(frozen=True)
class KernelPolicy:
    fused_ops: bool = False
    sparse_attention: LayoutFactory | None = None
    layout_seed: int = 0  # random layout blocks are drawn under it, the same on every rank

    @property
    def rewrites(self) -> bool:
        return self.fused_ops or self.sparse_attention is not None
