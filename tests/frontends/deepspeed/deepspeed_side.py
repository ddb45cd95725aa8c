"""Running a script under DeepSpeed 0.19.8's own interpreter (DEEPSPEED_PYTHON, on its CPU
accelerator), for the tests that compare shardwise's answers with DeepSpeed's."""

import json
import os
import subprocess
from typing import Any

import pytest


def deepspeed_json(script: str, *args: str, timeout: float = 300, python: str | None = None) -> Any:
    """The JSON value `script` prints on its last line, run with `args` under DEEPSPEED_PYTHON
    (or `python`: the same script under another interpreter); fails on a non-zero exit,
    showing the end of its stderr."""
    ran = subprocess.run([python or os.environ["DEEPSPEED_PYTHON"], "-c", script, *args], capture_output=True,
                         text=True, timeout=timeout, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    return json.loads(ran.stdout.strip().splitlines()[-1])


# A script's lines that make it rank 0 of 1 on a free port, before `init_distributed`
# (two suites at once must not meet on one port).
ONE_RANK = """
import os, socket
with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = str(probe.getsockname()[1])
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
"""


# A test that compares with DeepSpeed itself runs where DEEPSPEED_PYTHON names its interpreter.
needs_deepspeed = pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an "
                                     "interpreter with DeepSpeed 0.19.8 to compare with it")


def deepspeed_trains(source: str, configs: dict[str, Any], call: str, imports: str = "") -> dict[str, Any]:
    """Per config name, what `call` returns when DeepSpeed runs it on one rank: `source`
    defines the training (as the shardwise side runs it too), `call` evaluates with
    `deepspeed` and `config` bound (`imports`: more lines before it, e.g. a module the call
    takes)."""
    script = ONE_RANK + source + f"""
import json, sys, deepspeed
{imports}
deepspeed.init_distributed("gloo")
configs = json.loads(sys.argv[1])
print(json.dumps({{name: {call} for name, config in configs.items()}}))
"""
    return deepspeed_json(script, json.dumps(configs))
