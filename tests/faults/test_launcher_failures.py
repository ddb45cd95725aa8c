"""A failing rank under `shardwise run` is named in one line before torchrun's report
(reliability issue 30)."""

from tests.tools.launcher.test_launcher import run_shardwise


def test_the_failing_rank_and_its_exception_come_first_in_one_line(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    raise ValueError('bad batch 7')\n")

    finished = run_shardwise(["--nproc", "2", str(script)], tmp_path)

    assert finished.returncode == 1
    first = finished.stderr.index("shardwise run: rank 1 failed first: ValueError: bad batch 7\n")
    assert first < finished.stderr.index("fails.py FAILED"), finished.stderr
