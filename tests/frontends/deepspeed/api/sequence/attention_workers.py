"""Rank functions for test_layer.py: `DistributedAttention` on each rank's positions,
against attention over the whole sequences in one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

BATCH, POSITIONS, HEAD_SIZE = 2, 8, 4


def causal_attention(layout: str):
    """sdpa, causal, for [batch, seq, heads, dim] or [seq, batch, heads, dim] (grouped
    key/value heads repeated by sdpa)."""

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        to_bhsd = (lambda t: t.permute(0, 2, 1, 3)) if layout == "bshd" else (lambda t: t.permute(1, 2, 0, 3))
        out = nn.functional.scaled_dot_product_attention(to_bhsd(query), to_bhsd(key), to_bhsd(value),
                                                         is_causal=True, enable_gqa=True)
        return out.permute(0, 2, 1, 3) if layout == "bshd" else out.permute(2, 0, 1, 3)

    return attend


def sequence_dim(layout: str) -> int:
    return 1 if layout == "bshd" else 0


def whole_inputs(layout: str, heads: int, kv_heads: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """q, k, v and the output's gradient over the whole sequences."""
    generator = torch.Generator().manual_seed(seed)

    def shape(count: int) -> tuple[int, ...]:
        return (BATCH, POSITIONS, count, HEAD_SIZE) if layout == "bshd" else (POSITIONS, BATCH, count, HEAD_SIZE)

    return {"q": torch.randn(shape(heads), generator=generator), "k": torch.randn(shape(kv_heads), generator=generator),
            "v": torch.randn(shape(kv_heads), generator=generator), "g": torch.randn(shape(heads), generator=generator)}


def rotary(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of shape [1, seq, 1, rotated features]: DeepSpeed permutes them to
    [seq, 1, 1, rotated], broadcast over a [seq, batch, heads, dim] layout."""
    angles = torch.rand(1, POSITIONS, 1, HEAD_SIZE, generator=torch.Generator().manual_seed(seed)) * 3
    return angles.cos(), angles.sin()


def reference(layout: str, given: dict[str, torch.Tensor], with_rotary: bool) -> dict[str, torch.Tensor]:
    """Whole sequences in one process: output and the gradients of (output * g).sum()."""
    from shardwise.frontends.deepspeed.api.sequence.layer import apply_rotary_pos_emb

    q, k, v = (given[name].clone().requires_grad_() for name in "qkv")
    query, key = q, k
    if with_rotary:
        cos, sin = (frequencies.permute(1, 0, 2, 3) for frequencies in rotary())
        query, key = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
    out = causal_attention(layout)(query, key, v)
    (out * given["g"]).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def shard(tensor: torch.Tensor, layout: str, rank: int, size: int) -> torch.Tensor:
    return tensor.chunk(size, dim=sequence_dim(layout))[rank]


def distributed_attention(rank: int, world_size: int, cases: list[tuple[str, int, int, bool]]
                          ) -> list[dict[str, float]]:
    """`attention_errors` of each (layout, heads, key/value heads, with rotary) case."""
    return [attention_errors(rank, world_size, *case) for case in cases]


def attention_errors(rank: int, world_size: int, layout: str, heads: int, kv_heads: int,
                     with_rotary: bool) -> dict[str, float]:
    """Each rank's shard through DistributedAttention (over a new group of every rank, as
    a script's own), against the same shard of the whole-sequence reference: relative
    errors of the output and the input gradients."""
    from shardwise.frontends.deepspeed.api.sequence.layer import DistributedAttention

    given = whole_inputs(layout, heads, kv_heads)
    want = reference(layout, given, with_rotary)
    seq = sequence_dim(layout)
    attention = DistributedAttention(causal_attention(layout), dist.new_group(list(range(world_size))),
                                     scatter_idx=2, gather_idx=seq)
    q, k, v = (shard(given[name], layout, rank, world_size).clone().requires_grad_() for name in "qkv")
    out = attention(q, k, v, 1 - seq, rotary() if with_rotary else None)
    (out * shard(given["g"], layout, rank, world_size)).sum().backward()
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return {name: ((got[name] - shard(want[name], layout, rank, world_size)).norm()
                   / shard(want[name], layout, rank, world_size).norm()).item() for name in got}


def ours_for_deepspeed(rank: int, world_size: int, layout: str, given: dict[str, torch.Tensor]
                       ) -> dict[str, torch.Tensor]:
    """Our layer on the inputs DeepSpeed's got (test_layer's DEEPSPEED_SIDE), its shards."""
    from shardwise.frontends.deepspeed.api.sequence.layer import DistributedAttention

    seq = sequence_dim(layout)
    attention = DistributedAttention(causal_attention(layout), dist.new_group([0, 1]), scatter_idx=2, gather_idx=seq)
    q, k, v = (shard(given[name], layout, rank, world_size).clone().requires_grad_() for name in "qkv")
    out = attention(q, k, v, 1 - seq)
    (out * shard(given["g"], layout, rank, world_size)).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def refusals(rank: int, world_size: int) -> dict[str, str]:
    """What the layer refuses, with its message."""
    from shardwise.frontends.deepspeed.api.sequence.layer import DistributedAttention

    group = dist.new_group([0, 1])
    messages = {}

    def record(name: str, call) -> None:
        try:
            call()
        except ValueError as error:
            messages[name] = str(error)

    attention = DistributedAttention(causal_attention("bshd"), group, scatter_idx=2, gather_idx=1)
    x = torch.randn(BATCH, POSITIONS // 2, 4, HEAD_SIZE)
    one_kv = torch.randn(BATCH, POSITIONS // 2, 1, HEAD_SIZE)
    record("kv_heads", lambda: attention(x, one_kv, one_kv, 0))
    record("batch_dim", lambda: attention(x, x, x, 2))
    record("three_d", lambda: attention(x[..., 0], x[..., 0], x[..., 0], 0))
    record("indices", lambda: DistributedAttention(causal_attention("bshd"), group, scatter_idx=2, gather_idx=3))
    return messages
