"""`deepspeed.runtime.data_pipeline.data_sampling`: curriculum learning's sampler, its
offline metric analyzer and the indexed-dataset file format both read and write."""

from shardwise.frontends.deepspeed.api.runtime.data_pipeline.data_sampling import (
    data_analyzer,
    data_sampler,
    indexed_dataset,
)

__all__ = ["data_analyzer", "data_sampler", "indexed_dataset"]
