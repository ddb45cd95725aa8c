"""Megatron sequence parallelism shrinks the activations of the norm and dropout regions,
and the inputs the column-parallel layers keep for backward, by the tensor size (issue 10
item 3): measured with saved-tensor hooks and equal, to the byte, to
`sequence_region_activation_bytes`. Before the column-parallel layers re-gathered their
input in backward, their saved input stayed whole under sequence parallelism."""

from functools import lru_cache

from shardwise.formulas.parallel_activation import sequence_region_activation_bytes
from shardwise.tools.testing import run_distributed
from tests.runtime.parallel.activation_workers import BATCH, LAYERS, SEQ, WIDTH, saved_bytes_by_module

REGIONS = {"norm": "LayerNorm", "dropout": "Dropout", "column_input": "ColumnParallelLinear"}


@lru_cache(maxsize=None)
def measured(tensor: int, sequence_parallel: bool) -> dict[str, int]:
    results = run_distributed(saved_bytes_by_module, tensor, sequence_parallel)
    assert all(result == results[0] for result in results[1:])
    saved = results[0]
    return {region: saved.get(module, 0) for region, module in REGIONS.items()}


def test_regions_fall_by_the_tensor_size_with_sequence_parallelism():
    plain, sharded = measured(2, False), measured(2, True)
    for region in REGIONS:
        assert sharded[region] * 2 == plain[region], (region, plain, sharded)


def test_saved_bytes_equal_the_formulas():
    for tensor, sequence_parallel in ((2, False), (2, True)):
        expected = sequence_region_activation_bytes(BATCH, SEQ, WIDTH, tensor, LAYERS, sequence_parallel)
        assert measured(tensor, sequence_parallel) == expected, (tensor, sequence_parallel)


def test_plain_tensor_parallelism_keeps_the_whole_sequence_in_these_regions():
    assert measured(2, False) == sequence_region_activation_bytes(BATCH, SEQ, WIDTH, 1, LAYERS, False)
