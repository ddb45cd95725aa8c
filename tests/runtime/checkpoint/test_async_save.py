"""Asynchronous saves (checkpoint/background.py): the same files as a synchronous save,
written while training goes on, failures raised on every rank."""

from __future__ import annotations

import pytest

from shardwise.runtime.checkpoint.manifest import list_tags
from shardwise.tools.testing import run_distributed
from tests.runtime.checkpoint.async_workers import async_then_resume, failing_async_write, sync_then_async
from tests.runtime.checkpoint.workers import PARTITION_EVERYTHING
from tests.runtime.zero.workers import Case


@pytest.mark.parametrize("case", [Case(stage=1), Case(stage=3, extra_config=PARTITION_EVERYTHING)],
                         ids=["stage1", "stage3"])
def test_async_checkpoint_equals_sync_byte_for_byte(case, tmp_path):
    results = run_distributed(sync_then_async, 2, case, str(tmp_path))
    assert all(result["trained_during_write"] for result in results)
    sync, asynchronous = tmp_path / "sync" / "same", tmp_path / "async" / "same"
    names = sorted(path.name for path in sync.iterdir())
    assert names == sorted(path.name for path in asynchronous.iterdir())
    assert "rank_00001.safetensors" in names
    for name in names:  # tensors, records (RNG states included), meta, manifest
        assert (sync / name).read_bytes() == (asynchronous / name).read_bytes(), name
    assert (tmp_path / "async" / "latest").read_text().strip() == "same"


def test_failed_async_write_raises_on_every_rank_and_keeps_latest(tmp_path):
    results = run_distributed(failing_async_write, 2, Case(stage=2), str(tmp_path), 1)
    for rank, result in enumerate(results):
        assert result["latest"] == "good"
        assert "asynchronous save of checkpoint 'second' failed" in result["error"]
        assert ("No space left on device" in result["error"] if rank == 1
                else "rank 1 failed while writing its checkpoint files" in result["error"])
    assert list_tags(tmp_path) == ["good"]


def test_next_save_and_destroy_join_the_write_and_the_checkpoint_resumes(tmp_path):
    results = run_distributed(async_then_resume, 2, Case(stage=2), str(tmp_path))
    assert list_tags(tmp_path) == ["global_step1", "global_step2"]
    for result in results:
        assert result["steps"] == 2
        assert result["resumed"] == result["after"]
