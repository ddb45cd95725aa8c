"""DeepSpeed's ZeRO-2/3 model-state memory estimators (`deepspeed.runtime.zero.stage3` /
`stage_1_and_2`): DeepSpeed 0.19.8's table and numbers (its own run when DEEPSPEED_PYTHON
is set, its printed table otherwise), and where they agree with shardwise's formulas
(docs/formulas.md#model-states-per-rank; docs/deepspeed.md#memory-estimators says why the
rest differ)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess

import pytest
from torch import nn

from shardwise.formulas.memory import Offload, placed_model_state_bytes
from shardwise.frontends.deepspeed.api.runtime.zero.stage3 import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from shardwise.frontends.deepspeed.api.runtime.zero.stage_1_and_2 import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
)

needs_deepspeed = pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an "
                                     "interpreter with DeepSpeed 0.19.8 to compare with it")

# printed by DeepSpeed 0.19.8 for estimate_zero3_..._all_cold(7e9, 5e8, 8, 2) and estimate_zero2_..._all_cold(7e9, 8, 2)
DEEPSPEED_TABLES = """\
Estimated memory needed for params, optim states and gradients for a:
HW: Setup with 2 nodes, 8 GPUs per node.
SW: Model with 7000M total params, 500M largest layer params.
  per CPU  |  per GPU |   Options
   88.01GB |   1.86GB | offload_param=OffloadDeviceEnum.cpu, offload_optimizer=OffloadDeviceEnum.cpu, zero_init=1
  312.92GB |   1.86GB | offload_param=OffloadDeviceEnum.cpu, offload_optimizer=OffloadDeviceEnum.cpu, zero_init=0
   78.23GB |   2.68GB | offload_param=none, offload_optimizer=OffloadDeviceEnum.cpu, zero_init=1
  312.92GB |   2.68GB | offload_param=none, offload_optimizer=OffloadDeviceEnum.cpu, zero_init=0
   22.35GB |   9.20GB | offload_param=none, offload_optimizer=none, zero_init=1
  312.92GB |   9.20GB | offload_param=none, offload_optimizer=none, zero_init=0
Estimated memory needed for params, optim states and gradients for a:
HW: Setup with 2 nodes, 8 GPUs per node.
SW: Model with 7000M total params.
  per CPU  |  per GPU |   Options
  625.85GB |  13.04GB | offload_optimizer=OffloadDeviceEnum.cpu
  312.92GB |  20.37GB | offload_optimizer=none
"""


def test_prints_deepspeeds_tables(capsys):
    assert estimate_zero3_model_states_mem_needs_all_cold(int(7e9), int(5e8), 8, 2) is None
    assert estimate_zero2_model_states_mem_needs_all_cold(int(7e9), 8, 2) is None
    assert capsys.readouterr().out == DEEPSPEED_TABLES


def test_a_live_model_counts_shared_parameters_once_and_its_largest_module():
    model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 8), nn.Linear(8, 100, bias=False))
    model[2].weight = model[0].weight  # tied
    total, largest = 100 * 8 + 8 * 8 + 8, 100 * 8
    assert estimate_zero3_model_states_mem_needs(total, largest, 4, 1, cpu_offload=False) == (
        int(largest * 4 * 4 * 1.5), 4 * largest + int(18 * total / 4), 4 * largest)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=4)
        estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node=4)
        estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=4)
        estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node=4)
    zero3_live, zero3_cold, zero2_live, zero2_cold = printed.getvalue().split("Estimated")[1:]
    assert (zero3_live, zero2_live) == (zero3_cold, zero2_cold)


@pytest.mark.parametrize("params, gpus_per_node, nodes, largest", [(6_000_000, 4, 1, 40_000), (7_000_000, 2, 2, 0)])
def test_where_deepspeeds_estimate_agrees_with_shardwises_formulas(params, gpus_per_node, nodes, largest):
    """Mixed precision and Adam (K = 12). On the GPU DeepSpeed adds the largest layer
    gathered in fp32 (4L) and, with nothing offloaded, an fp32 gradient partition shardwise
    does not keep (4 bytes a parameter of the partition; at stage 3 its 18 count 2 more than
    shardwise's 16); on the host its numbers are a node's, times the 1.5 safety factor."""
    ranks = gpus_per_node * nodes

    def shardwise(stage: int, offload: Offload) -> dict[str, int]:
        placed = placed_model_state_bytes(params, ranks, stage, offload)
        return {device: sum(placed[device].values()) for device in ("gpu", "cpu")}

    optimizer_on_host, all_on_host = Offload(optimizer="cpu"), Offload(optimizer="cpu", params="cpu")
    node_share = gpus_per_node * 1.5  # a node's ranks, times DeepSpeed's buffer factor (ZeRO-3)

    cpu, gpu = estimate_zero2_model_states_mem_needs(params, gpus_per_node, nodes, cpu_offload=True)
    assert gpu == shardwise(2, optimizer_on_host)["gpu"]
    if 4 * ranks <= 16:  # DeepSpeed's floor of 4 bytes a parameter per GPU not reached
        # its ZeRO-2 host figure is the whole job's optimizer (not divided among the nodes, as its ZeRO-3 one is)
        assert cpu == shardwise(2, optimizer_on_host)["cpu"] * ranks * 1.5
    cpu, gpu = estimate_zero2_model_states_mem_needs(params, gpus_per_node, nodes, cpu_offload=False)
    assert gpu == shardwise(2, Offload())["gpu"] + 4 * params // ranks

    cpu, gpu, layer = estimate_zero3_model_states_mem_needs(params, largest, gpus_per_node, nodes,
                                                            cpu_offload=True, cpu_offload_params=True)
    assert (gpu - layer, cpu) == (shardwise(3, all_on_host)["gpu"], shardwise(3, all_on_host)["cpu"] * node_share)
    cpu, gpu, layer = estimate_zero3_model_states_mem_needs(params, largest, gpus_per_node, nodes,
                                                            cpu_offload=True, cpu_offload_params=False)
    assert (gpu - layer, cpu) == (shardwise(3, optimizer_on_host)["gpu"],
                                  shardwise(3, optimizer_on_host)["cpu"] * node_share)
    _, gpu, layer = estimate_zero3_model_states_mem_needs(params, largest, gpus_per_node, nodes, cpu_offload=False)
    assert gpu - layer == shardwise(3, Offload())["gpu"] + 2 * params // ranks


ESTIMATES = """
import contextlib, io, json, sys, torch
from deepspeed.runtime.zero import stage3, stage_1_and_2
setups = [(12_345_678, 1_234_567, 1, 1), (7_000_000_000, 500_000_000, 8, 2), (1_500_000, 0, 3, 5), (999, 7, 2, 1)]
printed, returned = io.StringIO(), []
with contextlib.redirect_stdout(printed):
    for total, largest, gpus, nodes in setups:
        stage3.estimate_zero3_model_states_mem_needs_all_cold(total, largest, gpus, nodes)
        stage_1_and_2.estimate_zero2_model_states_mem_needs_all_cold(total, gpus, nodes, additional_buffer_factor=1.1)
        for offload in (True, False):
            returned.append(stage_1_and_2.estimate_zero2_model_states_mem_needs(total, gpus, nodes, offload))
            for params_offload in (True, False):
                for zero_init in (True, False):
                    returned.append(stage3.estimate_zero3_model_states_mem_needs(
                        total, largest, gpus, nodes, offload, params_offload, zero_init, 1.25))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 2000), torch.nn.ReLU(), torch.nn.Linear(2000, 10))
    stage3.estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=2, num_nodes=3)
    stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=8)
print(json.dumps({"printed": printed.getvalue(), "returned": returned}))
"""


@needs_deepspeed
def test_same_tables_and_numbers_as_deepspeed():
    theirs = subprocess.run([os.environ["DEEPSPEED_PYTHON"], "-c", ESTIMATES], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    namespace: dict = {}
    aliased = ESTIMATES.replace("from deepspeed.runtime.zero import",
                                "from shardwise.frontends.deepspeed.api.runtime.zero import")
    exec(aliased.replace("print(json.dumps(", "result = (("), namespace)
    ours = {"printed": namespace["printed"].getvalue(), "returned": [list(r) for r in namespace["returned"]]}
    assert ours == json.loads(theirs.stdout.strip().splitlines()[-1])
