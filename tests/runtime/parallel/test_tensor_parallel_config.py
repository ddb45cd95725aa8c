"""DeepSpeed's AutoTP spelling `tensor_parallel.autotp_size` is honoured as
`tensor_parallel.size` (0, DeepSpeed's default, and 1 leave tensor parallelism off)."""

import pytest

from shardwise.frontends.deepspeed.config import load_config
from shardwise.frontends.deepspeed.config.errors import ConfigError


@pytest.mark.parametrize("autotp, size", [(0, 1), (1, 1), (2, 2)])
def test_autotp_size_becomes_tensor_parallel_size(autotp, size):
    config = load_config({"train_batch_size": 8, "tensor_parallel": {"autotp_size": autotp}}, world_size=2)
    assert config.tensor_parallel.size == size


def test_autotp_size_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"'tensor_parallel.autotp_size' must be a non-negative integer \(0 = off\), "
                                          r"got -1"):
        load_config({"train_batch_size": 8, "tensor_parallel": {"autotp_size": -1}}, world_size=2)
    with pytest.raises(ConfigError, match=r"'tensor_parallel.autotp_size' asks for tensor_parallel.size 2 but "
                                          r"'tensor_parallel.size' is 4; keep one"):
        load_config({"train_batch_size": 8, "tensor_parallel": {"autotp_size": 2, "size": 4}}, world_size=4)
