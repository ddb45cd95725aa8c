"""`deepspeed.runtime.sequence_parallel.ulysses_sp`: Arctic Long Sequence Training (ALST)'s
Ulysses sequence parallelism for Hugging Face models, as scripts written for DeepSpeed
0.19.8 drive it themselves (its tutorial, ArcticTraining, Oumi, Accelerate's
`sp_backend="deepspeed"`):

    mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model, core_attn_implementation="sdpa",
                                                          sequence_parallel_size=2, micro_batch_size=1, ...)
    engine, *_ = deepspeed.initialize(model=model, config=config_with_sequence_parallel_size, mpu=mpu, ...)
    loader = UlyssesSPDataLoaderAdapter(loader, sp_rank=..., sp_group=..., sp_world_size=..., device=...)

Unlike shardwise's own Ulysses (`sequence_parallel.size` in the config; the model family
splits the positions inside forward, runtime/parallel/sequence/ulysses.py), here the
script does both halves: the adapter hands each rank of a sequence group its 1/S of the
positions of one whole batch, and the attention function of the model's attention
implementation is replaced in transformers' `ALL_ATTENTION_FUNCTIONS` by one that
exchanges positions for heads around it (the same all-to-all, `ulysses_attention`). The
model runs on its shard from the embedding to the logits; the script computes its shard's
loss from the pre-shifted `shift_labels` and averages the shards' losses over the group,
weighted by their counted tokens. The engine then only averages gradients over data x
sequence ranks (its `SequencePolicy.sharded_by_caller`).

Attention masks: a 4D mask made for the shard's positions is wrong for the whole sequence
(and quadratic in memory), so the wrapper drops it and the core attention runs causal;
positions come from `position_ids`, which every forward must carry (the adapter requires
them in each batch) and which are all-gathered for the core attention (flash attention
reads packed sequences from them).

The module's tiled computations (`TiledMLP`, `sequence_tiled_compute`,
`SequenceTiledCompute`, `TiledFusedLogitsLoss`) live in tiled_compute.py.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from shardwise.frontends.deepspeed.api.runtime.sequence_parallel import parallel_state_sp
from shardwise.frontends.deepspeed.api.runtime.sequence_parallel.tiled_compute import (
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.distributed.mesh import GroupHandle
from shardwise.runtime.parallel.sequence.ulysses import ulysses_attention

__all__ = ["SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP", "UlyssesSPAttentionHF",
           "UlyssesSPDataLoaderAdapter", "sequence_tiled_compute"]

log = logging.getLogger("shardwise")
# Implementations that always build a 4D (quadratic) mask the wrapper would have to drop.
MASK_BOUND_IMPLEMENTATIONS = ("eager", "paged|eager")
IGNORE_INDEX = -100  # the label cross-entropy skips, as in transformers


def sequence_communicator(group: dist.ProcessGroup) -> Communicator:
    """A shardwise communicator over a process group the script made (the mpu's)."""
    ranks = tuple(dist.get_process_group_ranks(group))
    return Communicator(GroupHandle("sequence", ranks, dist.get_rank(group), group, None))


class UlyssesSPAttentionHF(nn.Module):
    """A transformers attention function (module, query, key, value, mask, **kwargs), with
    (batch, heads, positions / S, head_dim) inputs, that runs `attn` over all positions of
    heads / S of the heads: all-to-all before and after (runtime/parallel/sequence/). Key and
    value heads fewer than S are repeated to S first (S a multiple of them).

    `seq_length_is_variable=False` fixes the shard length to `local_seq_length` (checked
    every call); otherwise any length is taken. `disable_in_eval`: in eval mode the module
    runs `attn` on its own positions only, for evaluation loops fed whole sequences."""

    def __init__(self, attn: Callable[..., Any], batch_size: int, attn_head_count: int, attn_head_size: int,
                 kv_head_count: int, num_hidden_layers: int, process_group: dist.ProcessGroup,
                 seq_length_is_variable: bool = False, local_seq_length: int | None = None,
                 global_seq_length: int | None = None, disable_in_eval: bool = False) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.comm = sequence_communicator(process_group)
        self.world_size = self.comm.size
        self.sp_rank = self.comm.rank
        self.batch_size = batch_size
        self.attn_head_count = attn_head_count
        self.attn_head_size = attn_head_size
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length = None if seq_length_is_variable else local_seq_length
        self.global_seq_length = None if seq_length_is_variable else global_seq_length
        self.disable_in_eval = disable_in_eval
        self.core_attn_implementation: str | None = None  # register_with_transformers names it
        self._last_positions: tuple[torch.Tensor, int, torch.Tensor] | None = None  # (shard, its version, whole)
        if not seq_length_is_variable and local_seq_length is None:
            raise ValueError("UlyssesSPAttentionHF: seq_length_is_variable=False needs local_seq_length, the fixed "
                             "length of each rank's shard; or pass seq_length_is_variable=True")
        if attn_head_count % self.world_size:
            raise ValueError(f"the model's {attn_head_count} attention heads do not divide over the sequence-parallel "
                             f"size {self.world_size}: each rank of the group takes an equal share of the heads")
        if kv_head_count % self.world_size and self.world_size % kv_head_count:
            raise ValueError(f"the model's {kv_head_count} key/value heads and the sequence-parallel size "
                             f"{self.world_size}: one must divide the other (KV heads are split over the group, or "
                             "repeated when there are fewer than its size)")

    def forward(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        self._check_shapes(query, key, value)
        if kwargs.get("position_ids") is None:
            raise ValueError("Ulysses sequence parallelism needs `position_ids` in every forward: each rank holds "
                             "a shard of the positions, and the core attention must see the whole sequence's "
                             "positions (torch.arange(seq_len) per sample, restarting at each document of a packed "
                             "sequence); UlyssesSPDataLoaderAdapter requires them in every batch")
        kwargs["position_ids"] = self._whole_positions(kwargs["position_ids"])
        core = self.attn if not args else (lambda m, q, k, v, mask, **kw: self.attn(m, q, k, v, mask, *args, **kw))
        return ulysses_attention(core, self.comm)(module, query, key, value, attention_mask, **kwargs)

    def _check_shapes(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        positions = self.local_seq_length if not self.seq_length_is_variable else query.shape[2]
        wanted_q = (self.batch_size, self.attn_head_count, positions, self.attn_head_size)
        wanted_kv = (self.batch_size, self.global_kv_head_count, positions, self.attn_head_size)
        if tuple(query.shape) != wanted_q or tuple(key.shape) != wanted_kv or tuple(value.shape) != wanted_kv:
            raise ValueError(f"rank {dist.get_rank()}: Ulysses attention expects query {wanted_q} and key/value "
                             f"{wanted_kv} (batch = micro_batch_size, heads, positions of this rank's shard, head "
                             f"size), got query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                             f"{tuple(value.shape)}: give register_with_transformers the micro_batch_size (and "
                             "seq_length) the loader yields")

    def _whole_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """(batch, positions / S) -> (batch, positions): every rank's shard, in rank order.
        Every attention layer of a forward gets the same `position_ids` tensor: it is
        gathered at the first and reused by the rest (each rank runs the same layers, so
        the ranks skip the same gathers)."""
        last = self._last_positions
        if last is not None and last[0] is position_ids and last[1] == position_ids._version:
            return last[2]
        with torch.no_grad():
            shard = position_ids.contiguous()
            gathered = shard.new_empty((self.world_size, *shard.shape))
            self.comm.all_gather(gathered.view(-1), shard.view(-1), "position_ids of the sequence shards").wait()
            whole = gathered.movedim(0, 1).flatten(1, 2)
        self._last_positions = (position_ids, position_ids._version, whole)
        return whole

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int, seq_length: int | None = None,
                                   seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                                   max_length: int | None = None) -> Any:
        """Build the sequence-parallel groups and make `core_attn_implementation`'s entry of
        transformers' `ALL_ATTENTION_FUNCTIONS` this exchange around the original, for every
        model of the process that uses it; returns the mpu (`parallel_state_sp`) to pass to
        `deepspeed.initialize`, or None for `sequence_parallel_size` 1 (nothing to do).

        `model_name_or_path`: the model (its config is read; its `_attn_implementation`
        must be the one named, else the wrapper would never run) or a name or path for
        `AutoConfig`. `max_length` is `seq_length`'s old name."""
        if sequence_parallel_size == 1:
            return None
        if max_length is not None:
            log.warning("register_with_transformers: `max_length` is deprecated, pass `seq_length`")
            seq_length = max_length if seq_length is None else seq_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("register_with_transformers: seq_length_is_variable=False needs `seq_length`, the fixed "
                             "length of every batch; or keep seq_length_is_variable=True")
        if not seq_length_is_variable and seq_length % sequence_parallel_size:
            raise ValueError(f"register_with_transformers: seq_length {seq_length} does not divide over "
                             f"sequence_parallel_size {sequence_parallel_size}: each rank takes an equal shard")

        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size=sequence_parallel_size)
        loaded = hasattr(model_name_or_path, "config")
        config = model_name_or_path.config if loaded else AutoConfig.from_pretrained(model_name_or_path)
        if loaded:  # a config from a name still says "eager" until a model is loaded: nothing to compare
            active = getattr(config, "_attn_implementation", None)
            if active is not None and active != core_attn_implementation:
                raise ValueError(f"register_with_transformers: core_attn_implementation '{core_attn_implementation}' "
                                 f"but the model runs attn_implementation '{active}': the wrapper replaces the "
                                 "named implementation only, so make them the same")
        if core_attn_implementation in MASK_BOUND_IMPLEMENTATIONS:
            raise ValueError(f"register_with_transformers: attn_implementation '{core_attn_implementation}' cannot "
                             "run Ulysses sequence parallelism: it always builds a 4D attention mask (quadratic in the "
                             "sequence), which a sequence shard cannot use; use 'sdpa' or a flash attention")
        if core_attn_implementation == "flex_attention":
            raise ValueError("register_with_transformers: 'flex_attention' is not supported by shardwise's Ulysses "
                             "(its block mask would be rebuilt for the whole sequence); use 'sdpa' or a flash "
                             "attention")
        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"register_with_transformers: '{core_attn_implementation}' is not an attention "
                             f"implementation transformers knows; choose one of {ALL_ATTENTION_FUNCTIONS.valid_keys()}")
        text = config.get_text_config()
        heads = text.num_attention_heads
        attention = cls(
            attn=ALL_ATTENTION_FUNCTIONS[core_attn_implementation],
            batch_size=micro_batch_size,
            attn_head_count=heads,
            attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
            kv_head_count=getattr(text, "num_key_value_heads", None) or heads,
            num_hidden_layers=text.num_hidden_layers,
            process_group=parallel_state_sp.get_sequence_parallel_group(),
            seq_length_is_variable=seq_length_is_variable,
            local_seq_length=None if seq_length_is_variable else seq_length // sequence_parallel_size,
            global_seq_length=None if seq_length_is_variable else seq_length,
            disable_in_eval=disable_in_eval,
        )
        attention.core_attn_implementation = core_attn_implementation

        def without_mask(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
            """The shard's mask is not the whole sequence's: dropped, the core runs causal."""
            return attention(module, query, key, value, None, *args, **kwargs)

        # The implementation's own entry is replaced (not a new name registered), so every
        # check transformers makes on the implementation's name still holds.
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = without_mask
        return parallel_state_sp


class UlyssesSPDataLoaderAdapter:
    """Wraps a DataLoader so that the S ranks of a sequence group train on one batch
    together: each refill takes one batch from every rank's loader, and the adapter then
    yields S micro-batches, the j-th being rank j's batch, of which each rank gets its 1/S
    of the positions (dimension 1 of every tensor; anything else is passed to all).

    `labels` become `shift_labels`, shifted before the split (each position's next token,
    -100 after the last) so that a shard's loss needs no token of its neighbour: the model
    is called without labels, and the script computes the loss from `shift_labels`.
    Every batch needs `position_ids` (the attention gathers them) and tensors of
    (batch, sequence length) whose length the group size divides."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: dist.ProcessGroup, sp_world_size: int,
                 device: torch.device | str) -> None:
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self.iter = iter(dl)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """The next S micro-batches; at the end of the loader, StopIteration after
        restarting it, so the next `for` runs the next epoch."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)
            raise
        if "position_ids" not in batch:
            raise ValueError("Ulysses sequence parallelism needs `position_ids` in every batch: after the split each "
                             "token must keep its position in the whole sequence (torch.arange(seq_len) per sample, "
                             "restarting at each document of a packed sequence); add them in the collate function")
        if "labels" not in batch:
            raise ValueError("UlyssesSPDataLoaderAdapter needs `labels` in every batch: they become the shards' "
                             "`shift_labels`, from which the script computes the loss")
        batches = self._gather(batch)
        for whole in batches:
            self.micro_batches.append(self._own_shard(whole))

    def _gather(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's batch, in rank order. Lengths may differ between ranks: tensors go
        padded to the longest and are cut back (gloo gathers equal sizes only)."""
        for key, value in batch.items():
            if torch.is_tensor(value) and value.shape[:2] != batch["input_ids"].shape[:2]:
                raise ValueError(f"{key}'s shape {tuple(value.shape)} must match input_ids' "
                                 f"{tuple(batch['input_ids'].shape)} in its first two dimensions (batch, sequence): "
                                 "every tensor of the batch is split along the sequence")
        shapes = [torch.zeros(2, dtype=torch.int64, device=self.device) for _ in range(self.sp_world_size)]
        dist.all_gather(shapes, torch.tensor(batch["input_ids"].shape[:2], dtype=torch.int64, device=self.device),
                        group=self.sp_group)
        shapes = [tuple(shape.tolist()) for shape in shapes]
        if len({rows for rows, _ in shapes}) > 1:
            raise ValueError(f"the ranks of the sequence group loaded batches of {[rows for rows, _ in shapes]} "
                             "samples: their loaders must yield the same batch size")
        longest = max(length for _, length in shapes)
        batches: list[dict[str, Any]] = [{} for _ in range(self.sp_world_size)]
        for key, value in batch.items():
            if torch.is_tensor(value):
                value = torch.nn.functional.pad(value.to(self.device), self._padding(value, longest))
                received = [torch.empty_like(value) for _ in range(self.sp_world_size)]
                with torch.no_grad():
                    dist.all_gather(received, value.contiguous(), group=self.sp_group)
                received = [whole[:, :length] for whole, (_, length) in zip(received, shapes)]
            else:
                received = [None] * self.sp_world_size
                dist.all_gather_object(received, value, group=self.sp_group)
            for whole, item in zip(batches, received):
                whole[key] = item
        return batches

    @staticmethod
    def _padding(value: torch.Tensor, longest: int) -> tuple[int, ...]:
        """`pad`'s widths (last dimension first) that lengthen dimension 1 to `longest`."""
        return (0, 0) * (value.dim() - 2) + (0, longest - value.shape[1])

    def _own_shard(self, batch: dict[str, Any]) -> dict[str, Any]:
        length = batch["input_ids"].shape[1]
        if length % self.sp_world_size:
            raise ValueError(f"a batch's sequence length {length} does not divide over sp_world_size "
                             f"{self.sp_world_size}: pad the batches to a multiple of it in the collate function")
        labels = batch.pop("labels")
        shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].contiguous()
        batch["shift_labels"] = shifted
        chunk = length // self.sp_world_size
        own = slice(chunk * self.sp_rank, chunk * (self.sp_rank + 1))
        # Held on the CPU until used: S batches of long sequences wait here at once.
        return {key: value[:, own].cpu() if torch.is_tensor(value) else value for key, value in batch.items()}
