"""`deepspeed.runtime.utils.PartitionedTensor`: each rank keeps its `partition_uniform`
piece of the flattened tensor, `full()` gathers the exact tensor back, and the meta
round-trips so a receiving rank can rebuild the object from meta plus its own piece."""

import pytest
import torch

from shardwise.frontends.deepspeed.api.runtime.utils import PartitionedTensor
from shardwise.tools.testing import run_distributed


def _split_and_gather(rank: int, world_size: int, shape: tuple[int, ...]) -> None:
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape) * 1.5
    part = PartitionedTensor(full)
    size, extra = divmod(full.numel(), world_size)
    start = rank * size + min(rank, extra)
    expected_piece = full.reshape(-1)[start:start + size + (rank < extra)]
    assert torch.equal(part.data(), expected_piece)
    assert part.local_size() == expected_piece.size() and part.full_size() == list(shape)
    assert torch.equal(part.full(), full)
    meta = part.to_meta()
    assert meta.dtype == torch.long
    assert meta.tolist()[:len(shape) + 3] == [len(shape), *shape, world_size, rank]
    rebuilt = PartitionedTensor.from_meta(meta, part.local_data)
    assert torch.equal(rebuilt.full(), full)
    with pytest.raises(TypeError, match="torch.long"):
        PartitionedTensor.from_meta(meta.float(), part.local_data)


@pytest.mark.parametrize("shape", [(8, 3), (7, 3)], ids=["even", "uneven"])
def test_partitioned_tensor_splits_and_gathers_exactly(shape):
    run_distributed(_split_and_gather, 2, shape, timeout=60)
