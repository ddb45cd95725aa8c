"""`shardwise run` when a rank fails or the job is interrupted early (reliability issue 30):
the failing rank is named in one line before torchrun's report, and a SIGINT during
start-up stops the job."""

import re
import signal
import subprocess
import time
from pathlib import Path

from tests.tools.launcher.test_launcher import ENV, SHARDWISE, run_shardwise


def test_the_failing_rank_and_its_exception_come_first_in_one_line(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    raise ValueError('bad batch 7')\n")

    finished = run_shardwise(["--nproc", "2", str(script)], tmp_path)

    assert finished.returncode == 1
    # Rank 0 may still be starting when rank 1 fails (a loaded machine): then torchrun stops
    # it, and the line counts it as having failed after rank 1.
    line = re.search(r"^shardwise run: rank 1 failed first: ValueError: bad batch 7( \(rank\(s\) 0 failed too\))?$",
                     finished.stderr, re.MULTILINE)
    assert line is not None, finished.stderr
    assert line.start() < finished.stderr.index("fails.py FAILED"), finished.stderr


def catches_sigint(pid: int) -> bool:
    """The process has a handler for SIGINT (bit 2 of SigCgt in /proc/PID/status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught & (1 << (signal.SIGINT - 1)))


def test_a_sigint_during_start_up_stops_the_job(tmp_path):
    # Started as a shell starts a background job (`shardwise run ... &`): SIGINT ignored,
    # until the command installs its own handling, first thing; the signal is sent at once
    # then, while the launcher is still importing and parsing, before any worker starts.
    script = tmp_path / "slow.py"
    script.write_text("import time\ntime.sleep(30)\nprint('ran to the end')\n")
    launcher = subprocess.Popen([*SHARDWISE, "--nproc", "2", str(script)], cwd=tmp_path, env=ENV, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.monotonic() + 30
    while not catches_sigint(launcher.pid):
        assert time.monotonic() < deadline and launcher.poll() is None
        time.sleep(0.01)
    launcher.send_signal(signal.SIGINT)
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 130, err
    assert "ran to the end" not in out
    assert f"shardwise run: interrupted by SIGINT; stopped every worker of {script}" in err
