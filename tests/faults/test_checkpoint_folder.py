"""A checkpoint folder that cannot be created is a CheckpointError on every rank, naming
the folder, the reason and the fix (reliability issue 30).

The campaign found it with a read-only folder; the tests run as root here, whom permissions
do not stop, so the folder's place is taken by a file instead: the same failure of the same
`mkdir`, with another reason."""

from shardwise.tools.testing import run_distributed
from tests.faults.workers import save_into


def test_a_folder_that_cannot_be_created_is_named_on_every_rank(tmp_path):
    (tmp_path / "taken").write_text("a file where the checkpoint folder should be")
    rank_0, rank_1 = run_distributed(save_into, 2, str(tmp_path / "taken" / "checkpoints"), timeout=60)
    assert rank_0.startswith(f"CheckpointError: cannot create the checkpoint folder {tmp_path}/taken/checkpoints/"), \
        rank_0
    assert "Not a directory" in rank_0 and "save into a folder this user can write to" in rank_0, rank_0
    assert rank_1 == f"CheckpointError: rank 1: rank 0 failed while preparing the checkpoint directory: {rank_0}"
