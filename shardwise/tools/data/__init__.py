"""Built-in training data: a byte-level corpus of the standard library's source, and a
sampler that gives every rank its share of a world-size-independent global batch."""

from shardwise.tools.data.corpus import (
    DEFAULT_MAX_BYTES,
    build_corpus,
    load_tokens,
    prepare_corpus,
    split_tokens,
    stdlib_source_files,
)
from shardwise.tools.data.sampler import BlockSampler

__all__ = [
    "DEFAULT_MAX_BYTES",
    "BlockSampler",
    "build_corpus",
    "load_tokens",
    "prepare_corpus",
    "split_tokens",
    "stdlib_source_files",
]
