"""`deepspeed.utils.groups`: before `initialize`, DeepSpeed 0.19.8's answers without a
model-parallel unit (the world is the data-parallel group; no sequence or expert group);
after it, the engine's layout, expert groups included once an MoE layer with `ep_size`
made them. Compared with DeepSpeed itself in one process when DEEPSPEED_PYTHON is set."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.frontends.deepspeed.api.moe.layer import MoE
from shardwise.frontends.deepspeed.api.utils import groups
from shardwise.tools.testing import run_distributed


def answers(groups) -> dict:  # noqa: ANN001 (DeepSpeed's module or shardwise's)
    """What the getters say, in plain values (a group by its size and this rank's place)."""
    said = {
        "data": [groups._get_data_parallel_world_size(), groups._get_data_parallel_rank(),
                 dist.get_world_size(groups._get_data_parallel_group())],
        "sequence": [groups._get_sequence_parallel_world_size(), groups._get_sequence_parallel_rank()],
        "sequence_data": [groups._get_sequence_data_parallel_world_size(),
                          groups._get_sequence_data_parallel_rank(),
                          dist.get_world_size(groups._get_sequence_data_parallel_group())],
        "model": groups._get_model_parallel_world_size(),
        "experts": sorted(groups._get_expert_parallel_group_dict()),
    }
    try:
        said["sequence_group"] = dist.get_world_size(groups._get_sequence_parallel_group())
    except KeyError as error:
        said["sequence_group"] = f"KeyError: {error}"
    for name in ("get_data_parallel_world_size", "get_data_parallel_rank", "get_tensor_model_parallel_world_size",
                 "get_tensor_model_parallel_rank", "get_model_parallel_world_size",
                 "get_tensor_model_parallel_src_rank", "_get_broadcast_src_rank"):  # AutoTP's groups' getters
        try:
            said[name] = getattr(groups, name)()
        except AssertionError as error:
            said[name] = f"AssertionError: {error}"
    try:
        groups._get_expert_parallel_group("ep_size_2")
        said["ep_size_2"] = [groups._get_expert_parallel_world_size("ep_size_2"),
                             groups._get_expert_parallel_rank("ep_size_2"),
                             groups._get_expert_data_parallel_world_size("ep_size_2"),
                             groups._get_expert_data_parallel_rank("ep_size_2"),
                             dist.get_world_size(groups._get_expert_data_parallel_group("ep_size_2")),
                             groups._get_max_expert_size_name()]
    except AssertionError as error:
        said["ep_size_2"] = f"AssertionError: {error}"
    return said


class MoeNet(nn.Module):
    def __init__(self, ep_size: int):
        super().__init__()
        torch.manual_seed(0)
        self.moe = MoE(4, nn.Linear(4, 4), num_experts=2, ep_size=ep_size, k=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)[0].sum()


def _before_and_after(rank: int, world_size: int) -> list[dict]:
    before = answers(groups)
    model = nn.Linear(4, 4)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config={"train_micro_batch_size_per_gpu": 1,
                                                   "zero_optimization": {"stage": 1},
                                                   "optimizer": {"type": "Adam", "params": {"lr": 0.1}}})
    after = answers(groups)
    moe = MoeNet(ep_size=world_size)
    deepspeed.initialize(model=moe, model_parameters=moe.parameters(),
                         config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
                                 "optimizer": {"type": "Adam", "params": {"lr": 0.1}}})
    return [before, after, answers(groups)]


NO_TENSOR_GROUPS = {name: f"AssertionError: {what} group is not initialized"
                    for name, what in (("get_data_parallel_world_size", "data parallel"),
                                       ("get_data_parallel_rank", "data parallel"),
                                       ("get_tensor_model_parallel_world_size", "intra_layer_model parallel"),
                                       ("get_tensor_model_parallel_rank", "intra_layer_model parallel"),
                                       ("get_model_parallel_world_size", "intra_layer_model parallel"),
                                       ("get_tensor_model_parallel_src_rank", "intra_layer_model parallel"))}
NONE_YET = {"sequence_group": "KeyError: 'No sequence parallel group found'",
            "ep_size_2": "AssertionError: expert parallel group is not initialized", "experts": [],
            **NO_TENSOR_GROUPS, "_get_broadcast_src_rank": 0}


def test_before_initialize_as_deepspeed_after_it_the_engines_layout():
    for rank, (before, after, with_experts) in enumerate(run_distributed(_before_and_after, 2)):
        world = {"data": [2, rank, 2], "sequence": [1, 0], "sequence_data": [2, rank, 2], "model": 1}
        assert before == {**world, **NONE_YET}
        assert after == {**world, **NONE_YET}
        assert with_experts == {**world, **NONE_YET, "experts": ["ep_size_2"],
                                "ep_size_2": [2, rank, 1, 0, 1, "ep_size_2"]}


DEEPSPEED_SIDE = """
import json, os, socket, sys, torch, deepspeed
import torch.distributed as dist
from deepspeed.utils import groups
with socket.socket() as probe:  # a free port: two suites at once must not meet on one
    probe.bind(("127.0.0.1", 0))
    port = str(probe.getsockname()[1])
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
namespace = {}
exec(sys.argv[1], namespace)
deepspeed.init_distributed()
before = namespace["answers"](groups)
model = torch.nn.Linear(4, 4)
deepspeed.initialize(model=model, model_parameters=model.parameters(),
                     config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
                             "optimizer": {"type": "Adam", "params": {"lr": 0.1}}})
print(json.dumps([before, namespace["answers"](groups)]))
"""


def _with_tensor_parallelism(rank: int, world_size: int) -> dict:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    deepspeed.initialize(model=model, model_parameters=model.parameters(),
                         config={"train_micro_batch_size_per_gpu": 1,
                                 "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
                                 "tensor_parallel": {"autotp_size": 2, "plan": {"0": "colwise", "2": "rowwise"}}})
    said = answers(groups)
    groups.set_tensor_model_parallel_world_size(8)
    said["set_size"] = groups.get_model_parallel_world_size()
    groups.set_tensor_model_parallel_world_size(None)
    try:
        groups.initialize(ep_size=2)
    except Exception as error:  # DeepSpeed's DeprecatedException
        said["initialize"] = type(error).__name__
    return said


def test_with_tensor_parallelism_the_model_parallel_getters_answer_from_the_layout():
    for rank, said in enumerate(run_distributed(_with_tensor_parallelism, 2)):
        assert (said["get_data_parallel_world_size"], said["get_data_parallel_rank"]) == (1, 0)
        assert (said["get_tensor_model_parallel_world_size"], said["get_tensor_model_parallel_rank"],
                said["get_model_parallel_world_size"], said["get_tensor_model_parallel_src_rank"]) == (2, rank, 2, 0)
        assert said["_get_broadcast_src_rank"] == rank  # its sequence-data group is itself
        assert said["set_size"] == 8 and said["initialize"] == "DeprecatedException"


def _one_process(rank: int, world_size: int) -> list[dict]:
    return _before_and_after(rank, world_size)[:2]


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to compare with its groups")
def test_one_process_answers_as_deepspeed():
    import inspect

    source = "import torch.distributed as dist\n" + inspect.getsource(answers)
    ran = subprocess.run([os.environ["DEEPSPEED_PYTHON"], "-c", DEEPSPEED_SIDE, source], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    theirs = json.loads(ran.stdout.strip().splitlines()[-1])
    ours = json.loads(json.dumps(run_distributed(_one_process, 1)[0]))
    assert ours == theirs
