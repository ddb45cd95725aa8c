"""API misuse is an error, not a silent no-op (reliability issue, items 3-5): calling a
collective API on some ranks only, losing a peer, step() without backward(), use after
destroy(), a second engine on one model."""

import multiprocessing
import time

import pytest

import shardwise
from shardwise.tools.testing import DistributedTestError, run_distributed
from tests.faults.workers import die_before_initialize, lose_a_peer, save_on_one_rank
from tests.runtime.zero.workers import build_model, global_batch

CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def test_save_checkpoint_on_one_rank_only_fails_before_the_collective_timeout(tmp_path):
    started = time.monotonic()
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(save_on_one_rank, 2, str(tmp_path), "train", timeout=60,
                        env={"SHARDWISE_COLLECTIVE_TIMEOUT": "15"})
    message = str(failure.value)
    assert ("MismatchedCallError: rank 0: save_checkpoint is collective: every rank of the world group "
            "(ranks 0-1) must call it, but not all did within 3s") in message, message
    assert time.monotonic() - started < 15  # the collective timeout would have taken 15 s


def test_save_on_one_rank_while_another_loads_is_named_at_once(tmp_path):
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(save_on_one_rank, 2, str(tmp_path), "load", timeout=60)
    assert "must call it, but another rank called something else at the same point" in str(failure.value)


def test_a_lost_peer_is_named_by_rank(tmp_path):
    context = multiprocessing.get_context("spawn")
    report = tmp_path / "report.txt"
    ranks = [context.Process(target=lose_a_peer, args=(rank, 2, str(tmp_path / "store"), str(report)))
             for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(60)
        if process.is_alive():
            process.kill()
    message = report.read_text()
    assert message.startswith("CollectiveError: rank 0: reduce_scatter of gradients of unit"), message
    assert "[rank 1 (pid" in message and "on this host is no longer running]" in message, message


def test_a_rank_that_dies_before_initialize_is_named_by_the_survivor(tmp_path):
    context = multiprocessing.get_context("spawn")
    report = tmp_path / "report.txt"
    ranks = [context.Process(target=die_before_initialize, args=(rank, 2, str(tmp_path / "store"), str(report)))
             for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(60)
        if process.is_alive():
            process.kill()
    message = report.read_text()
    assert message.startswith("RuntimeError: rank 0: the job's start-up (initialize) failed: rank(s) 1 never began "
                              "initialize (it exited or failed before, or is still busy with something else)"), message


def test_step_without_backward_is_refused():
    engine = shardwise.initialize(build_model("gpt"), CONFIG)
    with pytest.raises(RuntimeError, match=r"engine.step\(\) was called without a backward since the last step"):
        engine.step()


def test_use_after_destroy_is_refused_and_the_model_can_get_a_new_engine():
    model = build_model("gpt")
    engine = shardwise.initialize(model, CONFIG)
    engine.destroy()
    x, y = global_batch(0, 2)
    with pytest.raises(RuntimeError, match=r"engine.forward\(\) after engine.destroy\(\)"):
        engine(x, y)
    again = shardwise.initialize(model, CONFIG)
    again.backward(again(x, y))
    again.step()


def test_a_second_engine_on_the_same_model_is_refused():
    model = build_model("gpt")
    first = shardwise.initialize(model, CONFIG)
    with pytest.raises(RuntimeError, match="this model is already trained by a shardwise engine"):
        shardwise.initialize(model, CONFIG)
    assert first.num_parameters() > 0
    del first
    # the hooks of an engine that was dropped without destroy() still reduce gradients
    with pytest.raises(RuntimeError, match="already trained by a shardwise engine"):
        shardwise.initialize(model, CONFIG, optimizer=None)
