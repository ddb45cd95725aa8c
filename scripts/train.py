"""The main job: `python3 scripts/train.py [shardwise train flags]`."""

import sys

from bootstrap import exec_in_venv

exec_in_venv(["-m", "shardwise.cli.main", "train", *sys.argv[1:]])
