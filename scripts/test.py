"""The test suite: `python3 scripts/test.py [pytest args]`.

pytest exits with 5 when it collects nothing; that is a failure here, not a pass.
"""

import subprocess
import sys

from bootstrap import ROOT, ensure_python

python = ensure_python("dev")
code = subprocess.run([str(python), "-m", "pytest", *sys.argv[1:]], cwd=ROOT).returncode
if code == 5:
    print("error: pytest collected no tests", file=sys.stderr)
sys.exit(code)
