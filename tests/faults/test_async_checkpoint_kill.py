"""A process SIGKILLed while its asynchronous save is being written (on the writer
thread, the training thread having moved on) leaves the previous checkpoint as `latest`,
loadable with the weights it saved: the background write goes through the same staging
directory and renames as a synchronous one."""

from __future__ import annotations

import signal

import pytest

from shardwise.runtime.checkpoint.manifest import list_tags
from shardwise.tools.testing import run_distributed
from shardwise.tools.testing.forkserver import preloaded_forkserver_context
from tests.runtime.checkpoint.interrupted_save import load_after_kill, save_then_freeze

FREEZE_TIMEOUT_S = 60


@pytest.mark.parametrize("phase", ["tensor-file", "before-latest"])
def test_sigkill_during_async_write_leaves_previous_checkpoint_loadable(phase, tmp_path):
    context = preloaded_forkserver_context()
    reports, child_end = context.Pipe(duplex=False)
    process = context.Process(target=save_then_freeze, args=(str(tmp_path), phase, child_end, True))
    process.start()
    child_end.close()
    try:
        assert reports.poll(FREEZE_TIMEOUT_S), "the saving process did not save its first checkpoint"
        saved_weights = reports.recv()
        assert reports.poll(FREEZE_TIMEOUT_S), f"the asynchronous write did not reach {phase!r}"
        assert reports.recv() == phase
        process.kill()
        process.join()
    finally:
        if process.is_alive():
            process.kill()
    assert process.exitcode == -signal.SIGKILL
    assert (tmp_path / "latest").read_text().strip() == "good"
    result = run_distributed(load_after_kill, 1, str(tmp_path))[0]
    assert result == {"client_state": {"saved": "first"}, "global_steps": 1, "weights": saved_weights}
    assert list_tags(tmp_path) == (["good", "second"] if phase == "before-latest" else ["good"])
