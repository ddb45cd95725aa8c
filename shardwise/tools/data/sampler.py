"""Which token blocks each rank trains on, chosen so runs at any world size are comparable.

A step's global batch is `global_batch` random windows of the corpus, drawn from a
generator seeded with (seed, step) alone. The world size only decides who computes which
rows: rank r takes the r-th contiguous slice of the batch and cuts it into its
micro-batches. So for a given seed and step, 1, 2 or 4 ranks train on exactly the same
rows, and since the engine averages gradients over ranks and micro-batches, on the same
global gradient. No state is kept, so resuming at step s needs only s.
"""

from __future__ import annotations

import numpy as np
import torch


class BlockSampler:
    """Random (input, target) blocks of `seq_len` tokens, targets shifted by one."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if global_batch < 1:
            raise ValueError(f"global_batch must be positive, got {global_batch}")
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"the corpus has {len(tokens)} tokens, too few for blocks of {seq_len} + 1")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed

    def global_offsets(self, step: int) -> np.ndarray:
        """Start of every row of the step's global batch."""
        generator = np.random.default_rng([self.seed, step])
        return generator.integers(0, len(self.tokens) - self.seq_len - 1, size=self.global_batch)

    def rank_rows(self, rank: int, world_size: int) -> slice:
        """The rows of the global batch that `rank` computes."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if self.global_batch % world_size:
            raise ValueError(
                f"global batch {self.global_batch} is not divisible by world size {world_size}"
            )
        per_rank = self.global_batch // world_size
        return slice(rank * per_rank, (rank + 1) * per_rank)

    def micro_batches(
        self, step: int, rank: int, world_size: int, accumulation_steps: int = 1
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`accumulation_steps` (x, y) pairs of int64 tensors, [micro_batch, seq_len] each."""
        rows = self.rank_rows(rank, world_size)
        per_rank = rows.stop - rows.start
        if per_rank % accumulation_steps:
            raise ValueError(
                f"{per_rank} rows per rank (global batch {self.global_batch} / world size "
                f"{world_size}) do not split into {accumulation_steps} micro-batches"
            )
        blocks = self._blocks(self.global_offsets(step)[rows])
        micro = per_rank // accumulation_steps
        return [
            (blocks[i : i + micro, :-1], blocks[i : i + micro, 1:])
            for i in range(0, per_rank, micro)
        ]

    def _blocks(self, offsets: np.ndarray) -> torch.Tensor:
        windows = np.stack([self.tokens[start : start + self.seq_len + 1] for start in offsets])
        return torch.from_numpy(windows.astype(np.int64))
