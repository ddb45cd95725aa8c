"""`deepspeed.sequence.layer`: Megatron-DeepSpeed's Ulysses attention, as DeepSpeed 0.19.8
names it. A script builds the group's attention around its own:

    attention = DistributedAttention(local_attention, groups._get_sequence_parallel_group())
    context = attention(query, key, value, batch_dim_idx)      # each rank: its positions

Each of the P ranks of the sequence group holds all heads of its s/P positions. Before
`local_attention` one all-to-all per tensor gives every rank all s positions of 1/P of
the heads; after it, the inverse all-to-all brings the output back to the rank's
positions (runtime/parallel/sequence/all_to_all.py explains the exchange). The layouts are
DeepSpeed's: [s, b, heads, d] with `batch_dim_idx` 1 (Megatron's) and [b, s, heads, d]
with `batch_dim_idx` 0; heads are dimension 2 in both. Which way an exchange goes is
read from `scatter_idx` alone (< 2: positions are scattered, heads gathered), as in
DeepSpeed, whose even-heads path never reads `gather_idx`.

Heads that do not divide over P (DeepSpeed's "uneven heads"): heads are dealt out in
key/value groups (`num_kv_heads`, read off the key tensor unless given), the first
`num_kv_heads % P` ranks taking one group more, as DeepSpeed's AutoTP split does; fewer
key/value heads than ranks is refused. `sp_stream` (DeepSpeed's overlap of the q/k/v
exchanges with the projections on a second CUDA stream) is taken, and the exchanges run
in order on the default stream: the same numbers, without that overlap.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardwise.frontends.deepspeed.api.runtime.sequence_parallel.ulysses_sp import sequence_communicator
from shardwise.runtime.distributed.collectives import Communicator

__all__ = ["DistributedAttention", "apply_rotary_pos_emb", "single_all_to_all"]

HEAD_DIM = 2  # heads are dimension 2 in both layouts


def _sequence_dim(batch_dim_idx: int) -> int:
    if batch_dim_idx not in (0, 1):
        raise ValueError(f"batch_dim_idx must be 0 ([batch, seq, heads, dim]) or 1 ([seq, batch, heads, dim]), "
                         f"got {batch_dim_idx}")
    return 1 - batch_dim_idx


def _communicator(group: dist.ProcessGroup | None) -> Communicator:
    return sequence_communicator(group if group is not None else dist.group.WORLD)


def _kv_groups_per_rank(num_kv_heads: int, size: int) -> list[int]:
    """Key/value groups held by each rank: as even as they go, the first ranks one more."""
    if num_kv_heads < size:
        raise ValueError(f"{num_kv_heads} key/value heads over a sequence-parallel group of {size} ranks: each "
                         "rank needs at least one head to attend over; use a sequence-parallel size of at most the "
                         "number of key/value heads")
    return [num_kv_heads // size + (1 if rank < num_kv_heads % size else 0) for rank in range(size)]


def _resolve_kv_heads(heads: int, size: int, num_kv_heads: int | None, scatters_heads: bool) -> int | None:
    """The key/value head count the heads are dealt by: the caller's, else (when the heads
    are whole here and do not divide) one group per head, as DeepSpeed reads it."""
    if num_kv_heads is None and scatters_heads and heads % size:
        num_kv_heads = heads
    if num_kv_heads is not None:
        _kv_groups_per_rank(num_kv_heads, size)  # refuses fewer groups than ranks
    return num_kv_heads


def _head_splits(whole_heads: int, size: int, num_kv_heads: int | None) -> list[int]:
    """Heads of each rank after the exchange, for `whole_heads` heads in all."""
    if num_kv_heads is None or num_kv_heads % size == 0:
        if whole_heads % size:
            raise ValueError(f"{whole_heads} heads do not divide over the sequence-parallel group of {size} ranks: "
                             "each rank takes an equal share of the heads (or give num_kv_heads, the key/value "
                             "head count, to deal them out by key/value groups)")
        return [whole_heads // size] * size
    if whole_heads % num_kv_heads:
        raise ValueError(f"{whole_heads} heads are not a whole number of groups of num_kv_heads={num_kv_heads}: "
                         "query heads come in groups of equal size per key/value head")
    per_group = whole_heads // num_kv_heads
    return [groups * per_group for groups in _kv_groups_per_rank(num_kv_heads, size)]


def _require_4d(input: Tensor) -> None:
    if input.dim() != 4:
        raise ValueError(f"DistributedAttention exchanges 4-D tensors ([seq, batch, heads, dim] or [batch, seq, "
                         f"heads, dim]), got shape {tuple(input.shape)}")


def _require_opposite(scatter_idx: int, gather_idx: int) -> None:
    """Backward exchanges with the two swapped: one must be the heads (>= 2), the other not."""
    if (scatter_idx < 2) == (gather_idx < 2):
        raise ValueError(f"scatter_idx={scatter_idx} and gather_idx={gather_idx}: one must be the heads dimension "
                         "(2) and the other the sequence's (0 for [seq, batch, heads, dim], 1 for [batch, seq, heads, "
                         "dim]), or the gradient's exchange goes the same way as the forward's")


def _positions_to_heads(input: Tensor, comm: Communicator, seq_dim: int, splits: list[int]) -> Tensor:
    """[.. s/P .., H, d] -> [.. s .., splits[rank], d]: head block j goes to rank j, and
    rank j's positions of this rank's block arrive, concatenated in rank order."""
    pieces = input.split(splits, dim=HEAD_DIM)
    send = torch.cat([piece.reshape(-1) for piece in pieces])
    own_shape = list(pieces[comm.rank].shape)
    received = send.new_empty(comm.size * pieces[comm.rank].numel())
    comm.all_to_all_uneven(received, send, output_splits=[pieces[comm.rank].numel()] * comm.size,
                           input_splits=[piece.numel() for piece in pieces],
                           what="attention inputs from sequence shards to head shards").wait()
    return torch.cat(received.view(comm.size, *own_shape).unbind(0), dim=seq_dim)


def _heads_to_positions(input: Tensor, comm: Communicator, seq_dim: int, splits: list[int]) -> Tensor:
    """[.. s .., splits[rank], d] -> [.. s/P .., H, d]: positions block j goes to rank j,
    and rank j's heads of this rank's positions arrive, concatenated in rank order."""
    if input.shape[seq_dim] % comm.size:
        raise ValueError(f"a sequence of {input.shape[seq_dim]} positions does not split over the "
                         f"{comm.handle.describe()}: pad it to a multiple of {comm.size}")
    pieces = input.chunk(comm.size, dim=seq_dim)
    send = torch.cat([piece.reshape(-1) for piece in pieces])
    shapes = [list(pieces[0].shape) for _ in splits]
    for shape, heads in zip(shapes, splits):
        shape[HEAD_DIM] = heads
    sizes = [torch.Size(shape).numel() for shape in shapes]
    received = send.new_empty(sum(sizes))
    comm.all_to_all_uneven(received, send, output_splits=sizes, input_splits=[piece.numel() for piece in pieces],
                           what="attention output from head shards to sequence shards").wait()
    return torch.cat([chunk.view(shape) for chunk, shape in zip(received.split(sizes), shapes)], dim=HEAD_DIM)


def _exchange(input: Tensor, comm: Communicator, scatter_idx: int, batch_dim_idx: int,
              num_kv_heads: int | None) -> Tensor:
    _require_4d(input)
    seq_dim = _sequence_dim(batch_dim_idx)
    if comm.size == 1:
        return input
    if scatter_idx < 2:  # heads are shards here: the whole count is this rank's share times P, by groups
        local = input.shape[HEAD_DIM]
        if num_kv_heads is None or num_kv_heads % comm.size == 0:
            splits = [local] * comm.size
        else:
            groups = _kv_groups_per_rank(num_kv_heads, comm.size)
            if local % groups[comm.rank]:
                raise ValueError(f"rank {comm.rank} holds {local} heads for {groups[comm.rank]} key/value groups: "
                                 "the output's heads must be those the inputs' exchange dealt to it")
            splits = [count * (local // groups[comm.rank]) for count in groups]
        return _heads_to_positions(input, comm, seq_dim, splits)
    return _positions_to_heads(input, comm, seq_dim, _head_splits(input.shape[HEAD_DIM], comm.size, num_kv_heads))


def single_all_to_all(input: Tensor, scatter_idx: int, gather_idx: int, batch_dim_idx: int,
                      group: dist.ProcessGroup | None, async_op: bool = False, handle: dict | None = None,
                      type: str | None = None, num_kv_heads: int | None = None) -> Tensor:
    """One exchange over `group` (not differentiable; `_SeqAllToAll` is): `scatter_idx` >= 2
    takes [.. s/P .., heads, d] to [.. s .., heads/P, d], `scatter_idx` < 2 the reverse.
    `async_op`/`handle`/`type` belong to DeepSpeed's stream overlap: the exchange is done
    when this returns."""
    comm = _communicator(group)
    scatters_heads = not scatter_idx < 2
    _require_4d(input)
    num_kv_heads = _resolve_kv_heads(input.shape[HEAD_DIM], comm.size, num_kv_heads, scatters_heads)
    return _exchange(input, comm, scatter_idx, batch_dim_idx, num_kv_heads)


class _SeqAllToAll(torch.autograd.Function):
    """The exchange as an autograd function; its gradient is the inverse exchange.
    DeepSpeed's argument list, whose stream/handle/type/is_fwd are its overlap's."""

    @staticmethod
    def forward(ctx: Any, group: dist.ProcessGroup | None, input: Tensor, scatter_idx: int, gather_idx: int,
                batch_dim_idx: int, stream: Any = None, handle: dict | None = None, type: str | None = None,
                is_fwd: bool = True, num_kv_heads: int | None = None) -> Tensor:
        comm = _communicator(group)
        _require_4d(input)
        _require_opposite(scatter_idx, gather_idx)
        # Resolved here, where the heads may still be whole: backward sees only a share.
        num_kv_heads = _resolve_kv_heads(input.shape[HEAD_DIM], comm.size, num_kv_heads, not scatter_idx < 2)
        ctx.comm, ctx.scatter_idx, ctx.gather_idx = comm, scatter_idx, gather_idx
        ctx.batch_dim_idx, ctx.num_kv_heads = batch_dim_idx, num_kv_heads
        return _exchange(input, comm, scatter_idx, batch_dim_idx, num_kv_heads)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        inverse = _exchange(grad.contiguous(), ctx.comm, ctx.gather_idx, ctx.batch_dim_idx, ctx.num_kv_heads)
        return (None, inverse, None, None, None, None, None, None, None, None)


def _rotate_half(x: Tensor) -> Tensor:
    """[a, b] halves of the last dimension -> [-b, a]."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(t: Tensor, freqs_cos: Tensor, freqs_sin: Tensor) -> Tensor:
    """Rotary position embedding of the first `freqs_cos.shape[-1]` features of `t` (the
    rest passes through): t * cos + rotate_half(t) * sin, the frequencies broadcast
    against `t` ([seq, ...] both)."""
    rotated = freqs_cos.shape[-1]
    head, tail = t[..., :rotated], t[..., rotated:]
    head = head * freqs_cos + _rotate_half(head) * freqs_sin
    return head if tail.shape[-1] == 0 else torch.cat((head, tail), dim=-1)


class DistributedAttention(nn.Module):
    """`local_attention(q, k, v, *args, **kwargs)` over all positions of 1/P of the heads,
    for inputs and output sharded by positions over `sequence_process_group` (module
    docstring). `num_kv_heads`: the key/value head count before sharding, which uneven
    heads are dealt by (default: the key tensor's head count at each call)."""

    def __init__(self, local_attention: nn.Module | Any, sequence_process_group: dist.ProcessGroup | None,
                 scatter_idx: int = 2, gather_idx: int = 0, sp_stream: Any = None,
                 num_kv_heads: int | None = None) -> None:
        super().__init__()
        _require_opposite(scatter_idx, gather_idx)
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream
        self.num_kv_heads = num_kv_heads
        self.sp_overlap_comm = False  # the exchanges run in order (module docstring)
        self.overlap_handles = None

    def layer_sync(self, layer: Any) -> None:
        """DeepSpeed's wait for the overlapped exchange; nothing overlaps here."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, batch_dim_idx: int, rotary_pos_emb: Any = None,
                *args: Any, **kwargs: Any) -> Tensor:
        """`rotary_pos_emb`: (cos, sin) of shape [b?, s, 1, rotated] each, applied to the
        exchanged query and key over the whole sequence, as DeepSpeed does (a [s, b, h, d]
        layout)."""
        num_kv_heads = self.num_kv_heads if self.num_kv_heads is not None else key.shape[HEAD_DIM]
        exchange = (self.scatter_idx, self.gather_idx, batch_dim_idx, None, None, None, True, num_kv_heads)
        query_layer = _SeqAllToAll.apply(self.spg, query, *exchange)
        key_layer = _SeqAllToAll.apply(self.spg, key, *exchange)
        value_layer = _SeqAllToAll.apply(self.spg, value, *exchange)
        if rotary_pos_emb is not None:
            cos, sin = (frequencies.permute(1, 0, 2, 3) for frequencies in rotary_pos_emb)
            query_layer = apply_rotary_pos_emb(query_layer, cos, sin)
            key_layer = apply_rotary_pos_emb(key_layer, cos, sin)
        context = self.local_attn(query_layer, key_layer, value_layer, *args, **kwargs)
        return _SeqAllToAll.apply(self.spg, context, self.gather_idx, self.scatter_idx, batch_dim_idx, None, None,
                                  None, True, num_kv_heads)
