"""DeepSpeed's hostfile and resource flags (`--include`, `--exclude`, `--num_nodes`,
`--num_gpus`): the selections are DeepSpeed 0.19.8's, compared with its own functions
when DEEPSPEED_PYTHON names an interpreter that has it."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from shardwise.tools.launcher.hostfile import parse_hostfile, read_hostfile, select_slots

POOL = {"a": 2, "b": 4, "c": 1}
# (include, exclude, num_nodes, num_gpus) -> DeepSpeed's selection
SELECTIONS = [
    ("", "", -1, -1),
    ("b:3,1@a", "", -1, -1),
    ("b:1@b:0", "", -1, -1),
    ("c@a", "", -1, -1),
    ("b:1@b", "", -1, -1),
    ("", "a@b:0", -1, -1),
    ("", "c:0", -1, -1),
    ("", "a:0@a", -1, -1),
    ("", "", 2, 3),
    ("", "", 5, -1),
    ("", "", 0, 0),
    ("", "", 1, -1),
]
EXPECTED = [
    {"a": [0, 1], "b": [0, 1, 2, 3], "c": [0]},
    {"a": [0, 1], "b": [1, 3]},
    {"b": [0, 1]},
    {"a": [0, 1], "c": [0]},
    {"b": [1]},
    {"b": [1, 2, 3], "c": [0]},
    {"a": [0, 1], "b": [0, 1, 2, 3]},
    {"a": [1], "b": [0, 1, 2, 3], "c": [0]},
    {"a": [0, 1, 2], "b": [0, 1, 2]},
    {"a": [0, 1], "b": [0, 1, 2, 3], "c": [0]},
    {"a": [0, 1], "b": [0, 1, 2, 3], "c": [0]},
    {"a": [0, 1]},
]

DEEPSPEED_SIDE = """
import json, sys
from deepspeed.launcher.runner import _parse_hostfile, parse_inclusion_exclusion, apply_num_nodes_and_gpus
pool = _parse_hostfile(["# hosts", "", "a slots=2", "b\\tslots=04 # four", "  c slots=1  "])
print(json.dumps([dict(pool)] + [dict(apply_num_nodes_and_gpus(parse_inclusion_exclusion(pool, i, e), n, g))
                                 for i, e, n, g in json.loads(sys.argv[1])]))
"""


@pytest.mark.parametrize(("selection", "expected"), list(zip(SELECTIONS, EXPECTED)))
def test_selection(selection, expected):
    include, exclude, num_nodes, num_gpus = selection
    assert select_slots(POOL, include=include, exclude=exclude, num_nodes=num_nodes, num_gpus=num_gpus) == expected


def test_hostfile_lines_as_deepspeed_reads_them(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# hosts\n\na slots=2\nb\tslots=04 # four\n  c slots=1  \n")
    pool = read_hostfile(path)
    assert pool == POOL and list(pool) == ["a", "b", "c"]


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to compare with its launcher's own functions")
def test_selections_equal_deepspeeds_own():
    ran = subprocess.run([os.environ["DEEPSPEED_PYTHON"], "-c", DEEPSPEED_SIDE, json.dumps(SELECTIONS)],
                         check=True, capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    pool, *selections = json.loads(ran.stdout.strip().splitlines()[-1])
    assert pool == POOL
    assert selections == EXPECTED


@pytest.mark.parametrize(("lines", "message"), [
    (["a slots=1", "b"], r"hostfile:2: 'b' is not `HOST slots=N`"),
    (["a slots = 2"], r"is not `HOST slots=N`"),
    (["a slots=1", "a slots=2"], r"hostfile:2: a is listed twice"),
    (["# nothing", ""], r"hostfile lists no host"),
])
def test_bad_hostfiles_are_refused_with_the_line(lines, message):
    with pytest.raises(ValueError, match=message):
        parse_hostfile(lines)


def test_a_missing_hostfile_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"no hostfile at .*missing: write one line `HOST slots=N`"):
        read_hostfile(tmp_path / "missing")


@pytest.mark.parametrize(("options", "message"), [
    ({"include": "a", "exclude": "b"}, "mutually exclusive"),
    ({"include": "a", "num_nodes": 1}, "cannot be combined"),
    ({"exclude": "a", "num_gpus": 0}, "cannot be combined"),  # DeepSpeed counts any value >= 0 as given
    ({"include": "d"}, r"host 'd' of --include is not in the hostfile"),
    ({"include": "b:9"}, r"host b has no slot 9 \(slots 0..3\)"),
    ({"include": "b:x"}, r"'b:x': slots are integers"),
    ({"exclude": "a@b@c"}, "leaves no host"),
])
def test_bad_selections_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        select_slots(POOL, **options)


def test_a_host_of_no_slot_is_refused_unless_excluded():
    with pytest.raises(ValueError, match=r"host a has slots=0: give it a slot count, or --exclude a"):
        select_slots({"a": 0, "b": 1})
    assert select_slots({"a": 0, "b": 1}, exclude="a") == {"b": [0]}
