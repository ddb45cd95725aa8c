"""The main job: `python3 scripts/train.py [shardwise train flags]`."""

import sys

from bootstrap import exec_in_python

exec_in_python(["-m", "shardwise.tools.cli.main", "train", *sys.argv[1:]], extra="plots")
