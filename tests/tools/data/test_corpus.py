"""The stdlib corpus: deterministic, capped, cached, and split without overlap."""

import hashlib

import numpy as np
import pytest

from shardwise.tools.data import build_corpus, load_tokens, prepare_corpus, split_tokens, stdlib_source_files
from shardwise.tools.data.corpus import corpus_cache_path, stdlib_root

SMALL = 300_000


def test_source_files_are_sorted_stdlib_python_files_without_third_party_packages():
    root = stdlib_root()
    files = stdlib_source_files()
    relative = [path.relative_to(root).as_posix() for path in files]
    assert len(files) > 500
    assert relative == sorted(relative)
    assert all(name.endswith(".py") for name in relative)
    assert not any("site-packages" in name for name in relative)
    assert "os.py" in relative


def test_corpus_is_deterministic_and_capped():
    first, second = build_corpus(SMALL), build_corpus(SMALL)
    assert len(first) == SMALL
    assert hashlib.sha256(first).hexdigest() == hashlib.sha256(second).hexdigest()
    first_file = stdlib_source_files()[0].read_bytes()
    assert first.startswith(first_file[: min(len(first_file), SMALL)])


def test_corpus_rejects_an_empty_budget():
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        build_corpus(0)


def test_prepare_corpus_builds_once_and_reuses_the_cache(tmp_path):
    path = prepare_corpus(tmp_path, SMALL)
    assert path == corpus_cache_path(tmp_path, SMALL)
    built_at = path.stat().st_mtime_ns
    assert prepare_corpus(tmp_path, SMALL) == path
    assert path.stat().st_mtime_ns == built_at
    tokens = load_tokens(path)
    assert tokens.dtype == np.uint8
    assert bytes(tokens) == build_corpus(SMALL)
    assert not list(tmp_path.glob("*.tmp"))


def test_split_holds_out_the_tail():
    tokens = np.arange(1000, dtype=np.uint8)
    train, val = split_tokens(tokens, val_fraction=0.1)
    assert len(train) == 900 and len(val) == 100
    assert np.array_equal(np.concatenate([train, val]), tokens)
    with pytest.raises(ValueError, match="val_fraction"):
        split_tokens(tokens, val_fraction=1.0)
