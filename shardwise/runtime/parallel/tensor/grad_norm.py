"""The global gradient norm when the model is split over a tensor group.

ZeRO's step check sums each rank's squared gradient norm over the data-parallel ranks,
which hold different pieces of one set of parameters. A tensor group adds a second split:
its ranks hold different blocks of the sharded parameters but identical copies of the
replicated ones (norms, row-parallel biases, position embeddings). The global norm counts
every sharded block and every replicated parameter once:

    |g|^2 = sum over tensor ranks of ( |g_sharded|^2 + |g_replicated|^2 / N_tensor )

so each rank scales its replicated part by 1/N_tensor and one small all-reduce over the
tensor group (control traffic) gives every rank the same value before the step check.
Clipping then uses one coefficient everywhere, which keeps replicated copies identical.
"""

from __future__ import annotations

import torch

from shardwise.runtime.distributed.collectives import CommStats, Communicator
from shardwise.runtime.distributed.mesh import ParallelMesh
from shardwise.runtime.optim.sharded import ShardAwareOptimizer
from shardwise.runtime.parallel.tensor.placement import is_tensor_sharded


class TensorParallelNorm:
    def __init__(self, comm: Communicator, store):
        """`store`: ZeRO's shard store (units, this rank's chunk and its gradient chunks)."""
        self.comm = comm
        self.store = store
        self.replicated: list[tuple[int, int, int]] = []  # (unit position, offset in chunk, numel)
        for position, unit in enumerate(store.units):
            for piece in unit.owned_pieces(store.chunk):
                if not is_tensor_sharded(piece.slot.param):
                    self.replicated.append((position, piece.chunk_offset, piece.numel))

    def __call__(self, local_squared: torch.Tensor) -> torch.Tensor:
        """This rank's squared norm -> the tensor group's, replicated parameters counted once."""
        gradients = self.store.gradients()
        replicated = torch.zeros((), dtype=torch.float32, device=local_squared.device)
        for position, offset, numel in self.replicated:
            piece = gradients[position][offset : offset + numel]
            replicated = replicated + torch.linalg.vector_norm(piece, dtype=torch.float32).square().to(replicated.device)
        total = (local_squared.float() - replicated * (1 - 1 / self.comm.size)).reshape(1)
        return self.comm.control_all_reduce(total, "squared gradient norm over the tensor group")[0]


def tensor_parallel_norm(mesh: ParallelMesh, zero, stats: CommStats) -> TensorParallelNorm | None:
    """The norm combiner for the engine, or None without a tensor group."""
    if mesh["tensor"].size == 1:
        return None
    if isinstance(zero.optimizer.optimizer, ShardAwareOptimizer):
        raise ValueError(
            f"optimizer {type(zero.optimizer.optimizer).__name__} computes whole-parameter statistics (trust "
            "ratios, factored or block state), which tensor_parallel.size > 1 splits across ranks; use Adam, "
            "AdamW or SGD with tensor parallelism"
        )
    return TensorParallelNorm(Communicator(mesh["tensor"], stats), zero.store)
