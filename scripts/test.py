"""The test suite: `python3 scripts/test.py [pytest args]`.

The tests run in one pytest-xdist worker per core (at most 4), a file per worker at a time
(`-n 0` runs them in this process). Most multi-rank tests spend much of their time waiting
(processes starting, a rank's timeout, a rendezvous): on a 2-core machine one process at
a time left the cores idle 40% of the suite's 17.5 minutes, and two workers took 12.4;
three took 13.7 (the ranks' processes then compete for the cores).

pytest exits with 5 when it collects nothing; that is a failure here, not a pass.
"""

import os
import subprocess
import sys

from bootstrap import ROOT, ensure_python

WORKERS = max(1, min(os.cpu_count() or 1, 4))

python = ensure_python("dev")
arguments = sys.argv[1:]
if not any(argument.startswith("-n") or argument in ("--numprocesses", "no:xdist") for argument in arguments):
    arguments = ["-n", str(WORKERS), "--dist", "loadfile", *arguments]
code = subprocess.run([str(python), "-m", "pytest", *arguments], cwd=ROOT).returncode
if code == 5:
    print("error: pytest collected no tests", file=sys.stderr)
sys.exit(code)
