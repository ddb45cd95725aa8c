"""DeepSpeed names that libraries import on their DeepSpeed paths: Lightning's
`runtime.base_optimizer.DeepSpeedOptimizer` (the optimizer `initialize` returns is one
exactly where DeepSpeed 0.19.8's is, and a `runtime.zero.stage_1_and_2.
DeepSpeedZeroOptimizer` / `runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3` where its
is), Accelerate's `checkpoint.utils.clone_tensors_for_torch_save` and
`launcher.runner.DEEPSPEED_ENVIRONMENT_NAME`, and the optimizer classes `ops.adagrad` /
`ops.lion`, and the engines' own modules (`runtime.engine.DeepSpeedEngine`,
`runtime.pipe.engine.PipelineEngine`), which training scripts import for type hints and
isinstance checks; each compared with DeepSpeed itself when DEEPSPEED_PYTHON names an
interpreter with it."""

from __future__ import annotations

import collections
import importlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.frontends.deepspeed.api.checkpoint.utils import clone_tensors_for_torch_save
from shardwise.frontends.deepspeed.api.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer
from shardwise.frontends.deepspeed.api.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from shardwise.frontends.deepspeed.api.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from shardwise.tools.testing import run_distributed

needs_deepspeed = pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an "
                                     "interpreter with DeepSpeed 0.19.8 to compare with it")

# (zero stage, precision) -> is the returned optimizer a (DeepSpeedOptimizer, ZeROOptimizer,
# DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3); "bf16+fp32" adds data_types.grad_accum_dtype fp32
CASES = [(0, None), (0, "bf16"), (1, None), (1, "bf16"), (1, "bf16+fp32"), (2, None), (2, "bf16+fp32"), (3, None)]
# DeepSpeed 0.19.8 on CPU: the torch optimizer itself at stage 0 in fp32, FP16_Optimizer for
# bf16 at stage 0, BF16_Optimizer at stage 1 in bf16 accumulating in fp32, else its ZeRO wrappers
DEEPSPEED_ANSWERS = [[False, False, False, False], [True, False, False, False], [True, True, True, False],
                     [True, True, True, False], [True, True, False, False], [True, True, True, False],
                     [True, True, True, False], [True, True, False, True]]
CLASSES = (DeepSpeedOptimizer, ZeROOptimizer, DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)


def _config(stage: int, precision: str | None) -> dict:
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    if precision is not None:
        config["bf16" if precision.startswith("bf16") else precision] = {"enabled": True}
    if precision == "bf16+fp32":
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def _wrapper_classes(rank: int, world_size: int, cases: list) -> list[list[bool]]:
    answers = []
    for stage, precision in cases:
        model = nn.Linear(4, 4)
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                       config=_config(stage, precision))
        assert isinstance(optimizer, torch.optim.Optimizer)  # still the torch optimizer (its class is checkpointed)
        answers.append([isinstance(optimizer, wrapper) for wrapper in CLASSES])
        assert answers[-1] == [isinstance(engine.optimizer, wrapper) for wrapper in CLASSES]
        engine.destroy()
    return answers


def test_the_returned_optimizer_is_a_deepspeed_optimizer_where_deepspeeds_is():
    assert run_distributed(_wrapper_classes, 1, CASES)[0] == DEEPSPEED_ANSWERS
    assert not isinstance(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1), DeepSpeedOptimizer)


DEEPSPEED_WRAPPERS = """
import json, os, socket, sys, torch, deepspeed
from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
with socket.socket() as probe:  # a free port: two suites at once must not meet on one
    probe.bind(("127.0.0.1", 0))
    port = str(probe.getsockname()[1])
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
answers = []
for config in json.loads(sys.argv[1]):
    model = torch.nn.Linear(4, 4)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    classes = (DeepSpeedOptimizer, ZeROOptimizer, DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)
    answers.append([isinstance(engine.optimizer, wrapper) for wrapper in classes])
print(json.dumps(answers))
"""


@needs_deepspeed
def test_deepspeed_answers_the_same():
    configs = [_config(stage, precision) for stage, precision in CASES]
    ran = subprocess.run([os.environ["DEEPSPEED_PYTHON"], "-c", DEEPSPEED_WRAPPERS, json.dumps(configs)],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert json.loads(ran.stdout.strip().splitlines()[-1]) == DEEPSPEED_ANSWERS


def _saved_bytes(item: object) -> int:
    buffer = io.BytesIO()
    torch.save(item, buffer)
    return buffer.tell()


def test_clone_tensors_for_torch_save_keeps_the_structure_and_drops_the_storage():
    flat = torch.arange(10_000, dtype=torch.float32)
    view = flat[:10]
    state = collections.OrderedDict(weight=view, rest=[flat[10:12], (flat[12:13], "text")], step=3)
    cloned = clone_tensors_for_torch_save(state)
    assert type(cloned) is collections.OrderedDict and list(cloned) == ["weight", "rest", "step"]
    assert isinstance(cloned["rest"], list) and isinstance(cloned["rest"][1], tuple)
    assert cloned["step"] == 3 and cloned["rest"][1][1] == "text"
    assert torch.equal(cloned["weight"], view) and cloned["weight"].untyped_storage().nbytes() == 40
    assert _saved_bytes(cloned) < _saved_bytes(state) / 10  # the view alone saved its 40 kB storage
    flat.add_(1)
    assert cloned["weight"][0].item() == 0.0  # a copy, not a view
    meta = clone_tensors_for_torch_save({"w": view}, device="meta")["w"]
    assert meta.device.type == "meta" and meta.shape == view.shape
    assert not clone_tensors_for_torch_save(nn.Parameter(torch.ones(2))).requires_grad


DEEPSPEED_CLONE = """
import collections, json, torch
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
flat = torch.arange(20, dtype=torch.float32)
state = collections.OrderedDict(weight=flat[:3], rest=[flat[3:5], (flat[5:6], "text")], step=3)
cloned = clone_tensors_for_torch_save(state)
describe = lambda x: (["tensor", x.tolist(), x.untyped_storage().nbytes()] if torch.is_tensor(x) else
                      [type(x).__name__, [describe(v) for v in x]] if isinstance(x, (list, tuple)) else
                      [type(x).__name__, {k: describe(v) for k, v in x.items()}] if isinstance(x, dict) else x)
print(json.dumps(describe(cloned)))
"""


@needs_deepspeed
def test_clone_tensors_for_torch_save_equals_deepspeeds():
    ran = subprocess.run([os.environ["DEEPSPEED_PYTHON"], "-c", DEEPSPEED_CLONE], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    code = DEEPSPEED_CLONE.replace("from deepspeed.checkpoint.utils", "from shardwise.frontends.deepspeed.api"
                                   ".checkpoint.utils")
    ours = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(ours.stdout) == json.loads(ran.stdout.strip().splitlines()[-1])


def test_the_alias_finds_the_names_libraries_import():
    code = (
        "from shardwise.frontends.deepspeed.alias import install_alias\n"
        "install_alias()\n"
        "from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer\n"
        "from deepspeed.checkpoint.utils import clone_tensors_for_torch_save\n"
        "from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME\n"
        "from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad\n"
        "from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion\n"
        "print(DEEPSPEED_ENVIRONMENT_NAME)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "DS_ENV_FILE": "cluster.env"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "cluster.env"  # DeepSpeed's rule: $DS_ENV_FILE, else .deepspeed_env


def test_the_environment_file_defaults_to_deepspeeds(monkeypatch):
    monkeypatch.delenv("DS_ENV_FILE", raising=False)
    runner = importlib.reload(deepspeed.launcher.runner)
    assert runner.DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"
    assert runner.DEEPSPEED_ENVIRONMENT_PATHS == [os.path.expanduser("~"), "."]


ENGINE_MODULES = """
import deepspeed
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.dataloader import RepeatingLoader
print(DeepSpeedEngine is deepspeed.DeepSpeedEngine, issubclass(PipelineEngine, DeepSpeedEngine),
      PipelineEngine is deepspeed.PipelineEngine, RepeatingLoader is deepspeed.utils.RepeatingLoader)
"""


def test_the_engines_import_from_deepspeeds_module_paths():
    """Through `import deepspeed` (the alias `shardwise run --as-deepspeed` installs); a plain
    model's engine is a DeepSpeedEngine and not a PipelineEngine (the pipeline's is one:
    test_pipeline_module.py)."""
    script = "from shardwise.frontends.deepspeed.alias import install_alias\ninstall_alias()\n" + ENGINE_MODULES
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["True"] * 4
    engine, *_ = deepspeed.initialize(model=nn.Linear(2, 2), config=_config(0, None))
    try:
        assert isinstance(engine, deepspeed.runtime.engine.DeepSpeedEngine)
        assert not isinstance(engine, deepspeed.PipelineEngine)
    finally:
        engine.destroy()


@needs_deepspeed
def test_deepspeed_has_the_same_engine_module_paths():
    environment = {**os.environ, "DS_ACCELERATOR": "cpu"}
    ran = subprocess.run([os.environ["DEEPSPEED_PYTHON"], "-c", ENGINE_MODULES], capture_output=True, text=True,
                         timeout=300, env=environment)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.split()[-4:] == ["True"] * 4
