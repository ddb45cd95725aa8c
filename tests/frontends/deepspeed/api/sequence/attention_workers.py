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


HIDDEN, HEADS, STEPS = 16, 4, 3
LR, EPS = 1e-2, 1e-4  # eps 1e-4: tests/runtime/zero/workers.py ADAM_EPS


class TinyCausalAttention(nn.Module):
    """One multi-head causal attention block, plain torch, as a Megatron-DeepSpeed script
    writes it: q/k/v projections, `local_attention` (sdpa; the script wraps it in
    DistributedAttention for sequence parallelism), the output projection, a residual."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)
        self.attention = causal_attention("bshd")

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (HEADS, HIDDEN // HEADS)) for t in self.qkv(x).chunk(3, dim=-1))
        context = self.attention(q, k, v) if not isinstance(self.attention, nn.Module) else self.attention(q, k, v, 0)
        return (x + self.out(context.flatten(-2)) - target).square().mean()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return [(torch.randn(BATCH, POSITIONS, HIDDEN, generator=generator),
             torch.randn(BATCH, POSITIONS, HIDDEN, generator=generator)) for _ in range(STEPS)]


def whole_sequences_in_one_process() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = TinyCausalAttention()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for x, target in batches():
        loss = model(x, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: param.detach().clone() for name, param in model.named_parameters()}


def megatron_deepspeed_ulysses(rank: int, world_size: int, stage: int) -> dict[str, dict]:
    """`ulysses_loop` with the sequence-parallel size from the config, and from
    `mesh_param=(1, 2)` (DeepSpeed's own Ulysses tests' form)."""
    return {"config": ulysses_loop(rank, stage, {"sequence_parallel_size": 2}, None),
            "mesh_param": ulysses_loop(rank, stage, {}, (1, 2))}


def ulysses_loop(rank: int, stage: int, sequence: dict, mesh_param: tuple[int, int] | None) -> dict:
    """DeepSpeed's Ulysses as its tests and Megatron-DeepSpeed drive it: initialize with
    sequence-parallel size 2, the group from `groups`, the model's attention wrapped in
    DistributedAttention over it, each rank fed its positions; the loss of the whole
    sequence is the mean of the shards' (equal lengths)."""
    from shardwise.frontends.deepspeed.alias import install_alias

    install_alias()
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention
    from deepspeed.utils import groups

    model = TinyCausalAttention()
    config = {"train_micro_batch_size_per_gpu": BATCH, **sequence, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": LR, "eps": EPS}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                      mesh_param=mesh_param)
    group = groups._get_sequence_parallel_group()
    model.attention = DistributedAttention(model.attention, group, scatter_idx=2, gather_idx=1)
    losses = []
    for x, target in batches():
        own = slice(rank * POSITIONS // 2, (rank + 1) * POSITIONS // 2)
        loss = engine(x[:, own], target[:, own])
        engine.backward(loss)
        engine.step()
        whole = loss.detach().clone()
        dist.all_reduce(whole, group=group)
        losses.append(whole.item() / 2)
    weights = {name: param.detach().clone() for name, param in engine.module.named_parameters()}
    return {"losses": losses, "weights": weights, "sequence_ranks": dist.get_process_group_ranks(group),
            "data_size": groups._get_data_parallel_world_size(), "batch": engine.train_batch_size()}


def who_splits_the_sequence(rank: int, world_size: int) -> dict[str, object]:
    """Whether initialize leaves the sequence to the script (`sharded_by_caller`) for a model
    shardwise knows (GPT) with and without a DistributedAttention in it; and the refusal of
    a DistributedAttention over both ranks with a config without sequence_parallel_size."""
    from shardwise.frontends.deepspeed.api import initialize
    from shardwise.frontends.deepspeed.api.sequence.layer import DistributedAttention
    from shardwise.models import GPT, GPTConfig

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    both = dist.new_group([0, 1])
    answers: dict[str, object] = {}
    for name, with_attention in (("gpt", False), ("gpt_with_distributed_attention", True)):
        model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8))
        if with_attention:
            model.attention = DistributedAttention(causal_attention("bshd"), both, scatter_idx=2, gather_idx=1)
        engine, *_ = initialize(model=model, config={**config, "sequence_parallel_size": 2})
        answers[name] = engine.policies.sequence.sharded_by_caller
    model = TinyCausalAttention()
    model.attention = DistributedAttention(model.attention, both, scatter_idx=2, gather_idx=1)
    try:
        initialize(model=model, config=config)
        answers["refusal"] = "initialize took it"
    except ValueError as error:
        answers["refusal"] = str(error)
    return answers
