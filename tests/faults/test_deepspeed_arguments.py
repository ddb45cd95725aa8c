"""A bad argument to a checkpoint call of the DeepSpeed-API engine (save_checkpoint,
load_checkpoint, save_16bit_model) is one clear error on every rank, at once (issue 34, item 3; issue 26, item 5): empty or None folders, a folder
of the wrong type, on every rank or on one; ranks naming different folders (a folder named
by the wall-clock second, with ranks straddling a second) or different tags. Without the
check, a rank raising alone leaves its peers in the save's first collective until the
timeout, and ranks writing to different folders leave a checkpoint nobody can load."""

import pytest

from shardwise.tools.testing import run_distributed
from tests.faults.deepspeed_workers import call_with, save_16bit_with

QUICK = 10  # seconds: well under the collective timeout the ranks run with


def raised(call, tmp_path, case, **kwargs):
    reports = run_distributed(call_with, 2, call, str(tmp_path), case, timeout=90,
                              env={"SHARDWISE_COLLECTIVE_TIMEOUT": "40"}, **kwargs)
    for kind, _, seconds, _ in reports:
        assert kind == "CheckpointArgumentError" or kind == "CheckpointTagMismatch", reports
        assert seconds < QUICK, reports
    assert reports[0][1] == reports[1][1]  # the same message on every rank
    return reports


@pytest.mark.parametrize("call", ["save_checkpoint", "load_checkpoint"])
@pytest.mark.parametrize("case,expected", [
    ("empty", "rank 0: {call}: the folder is ''; give a non-empty path"),
    ("none", "rank 1: {call}: the folder is None; give a non-empty path"),
    ("not_a_path", "rank 0: {call}: the folder must be a str or os.PathLike, got int (5)"),
])
def test_an_empty_or_wrong_folder_is_refused_on_every_rank(call, case, expected, tmp_path):
    message = raised(call, tmp_path, case)[0][1]
    assert expected.format(call=call) in message, message


def test_a_bad_folder_on_one_rank_is_named_on_every_rank(tmp_path):
    message = raised("save_checkpoint", tmp_path, "rank1_none")[0][1]
    assert "rank 1: save_checkpoint: the folder is None" in message and "rank 0:" not in message, message


def test_ranks_naming_different_folders_get_one_error_naming_each(tmp_path):
    message = raised("save_checkpoint", tmp_path, "folder_per_rank")[0][1]
    assert "the ranks name different checkpoint folders" in message, message
    assert f"rank 0: {tmp_path}/run-0" in message and f"rank 1: {tmp_path}/run-1" in message, message
    assert not list(tmp_path.iterdir())  # nothing written anywhere


@pytest.mark.parametrize("mode", ["Warn", "Fail"])
def test_ranks_giving_different_tags_get_one_error(mode, tmp_path):
    reports = raised("save_checkpoint", tmp_path, "tag_per_rank", tag_validation=mode)
    message = reports[0][1]
    assert "the checkpoint tag is not the same on every rank" in message, message
    assert "rank 0: 'tag-0'" in message and "rank 1: 'tag-1'" in message, message
    # under tag_validation Fail, DeepSpeed raises an AssertionError: so does this error
    assert [is_assertion for *_, is_assertion in reports] == [mode == "Fail"] * 2


def test_an_invalid_tag_on_one_rank_is_named(tmp_path):
    message = raised("load_checkpoint", tmp_path, "bad_tag")[0][1]
    assert "rank 1: load_checkpoint: invalid checkpoint tag '../up'" in message, message


@pytest.mark.parametrize("case,expected", [
    ("empty", "rank 0: save_16bit_model: the folder is ''; give a non-empty path"),
    ("rank1_none", "rank 1: save_16bit_model: the folder is None; give a non-empty path"),
    ("rank1_bad_name", "rank 1: save_16bit_model: save_filename must be a file name without a folder part"),
    ("not_a_name", "rank 0: save_16bit_model: save_filename must be a non-empty str, got 7"),
])
def test_save_16bit_model_refuses_a_bad_folder_or_name_on_every_rank(case, expected, tmp_path):
    """Without the check, rank 0 alone fails (or, given "", writes into the working
    directory) while rank 1 waits at the save's closing barrier."""
    reports = run_distributed(save_16bit_with, 2, str(tmp_path), case, timeout=90,
                              env={"SHARDWISE_COLLECTIVE_TIMEOUT": "40"})
    for kind, message, seconds, left in reports:
        assert kind == "EngineArgumentError" and seconds < QUICK and left == [], reports
        assert expected in message, message
    assert reports[0][1] == reports[1][1]
