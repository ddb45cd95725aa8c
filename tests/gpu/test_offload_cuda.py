"""ZeRO-Offload and ZeRO-Infinity on CUDA (C11, C12): the optimizer steps on the host from
page-locked buffers the device copies gradients into and parameters out of, or pages
through NVMe; training equals the fp32 CPU reference, bytes sit in the tier the formulas
say, and the host buffers really are pinned.

The cases are tests/offload's own (`case_for`, `partial_case`, `nvme_case`,
`nvme_params_case`) with `pin_memory` on, trained one after the other in one launch.
"""

import copy
import dataclasses
import os

import pytest

from shardwise.formulas.memory import ADAM_FP32_STATES, Offload, optimizer_state_bytes, placed_model_state_bytes
from tests.gpu.ranks import train_cases
from tests.gpu.target import DEVICE, LR, TOLERANCE, WORLD, cuda_only, needs_target, run_ranks
from tests.runtime.zero.test_host_offload import case_for
from tests.runtime.zero.test_nvme_offload import nvme_case, nvme_params_case
from tests.runtime.zero.test_partial_offload import partial_case
from tests.runtime.zero.workers import Case, assert_matches_reference, train_reference

pytestmark = needs_target

HOST_CASES = ["cpu-s1", "cpu-s2-acc2", "cpu-s3-params-acc2", "cpu-s2-bf16", "partial-s2"]


def pinned(case: Case) -> Case:
    """`case` with pin_memory on in each offload section it has, at the GPU tests' lr."""
    extra = copy.deepcopy(case.extra_config)
    for section in ("offload_optimizer", "offload_param"):
        block = extra["zero_optimization"].get(section)
        if block is not None and block.get("device", "none") != "none":
            block["pin_memory"] = True
    return dataclasses.replace(case, extra_config=extra, lr=LR)


def cases(swap: str) -> dict[str, Case]:
    return {name: pinned(case) for name, case in {
        "cpu-s1": case_for(1, "cpu"),
        "cpu-s2-acc2": case_for(2, "cpu", accumulation=2),
        "cpu-s3-params-acc2": case_for(3, "cpu", "cpu", accumulation=2),
        "cpu-s2-bf16": case_for(2, "cpu", dtype="bf16"),
        "partial-s2": partial_case(2, 0.5),
        "nvme-s2": nvme_case(swap, 2),
        "nvme-s3-params": nvme_params_case(swap),
    }.items()}


@pytest.fixture(scope="module")
def offload_runs(tmp_path_factory) -> dict:
    """{case name: [result per rank]}, and the swap directory's entries after the launch."""
    swap = str(tmp_path_factory.mktemp("swap"))
    named = cases(swap)
    per_rank = run_ranks(train_cases, list(named.values()), timeout=280)
    runs = {name: [results[index] for results in per_rank] for index, name in enumerate(named)}
    return {"cases": named, "runs": runs, "left_in_swap": os.listdir(swap)}


def reference_for(case: Case) -> dict:
    return train_reference(Case(model=case.model, lr=case.lr, accumulation=case.accumulation,
                                micro_batch=case.micro_batch, steps=case.steps), WORLD, per_micro_batch=True)


@pytest.mark.parametrize("name", list(cases("unused")))
def test_offloaded_training_matches_the_reference(name, offload_runs):
    case = offload_runs["cases"][name]
    expected = reference_for(case)
    for run in offload_runs["runs"][name]:
        assert run["device"] == DEVICE
        assert_matches_reference(run, expected, TOLERANCE[case.dtype])


@pytest.mark.parametrize("name", ["cpu-s1", "cpu-s2-acc2", "cpu-s3-params-acc2", "cpu-s2-bf16"])
def test_bytes_live_in_the_tier_the_formulas_say(name, offload_runs):
    case = offload_runs["cases"][name]
    zero = case.extra_config["zero_optimization"]
    offload = Offload(zero["offload_optimizer"]["device"], zero["offload_param"]["device"])
    for run in offload_runs["runs"][name]:
        padded = run["numel"] + run["padding"]
        expected = placed_model_state_bytes(
            padded, WORLD, case.stage, offload, dtype=case.dtype,
            optimizer_state_bytes_per_param=optimizer_state_bytes(ADAM_FP32_STATES, case.dtype),
        )
        for tier, device in (("device", "gpu"), ("host", "cpu")):
            for category in ("params", "grads", "optimizer_states"):
                assert run["memory_by_tier"][tier][category] == expected[device][category], (tier, category)


@cuda_only("page-locked (pinned) host memory")
@pytest.mark.parametrize("name", HOST_CASES)
def test_host_buffers_are_pinned(name, offload_runs):
    """The host gradient partition (and offloaded parameter shards) the device copies
    into are page-locked, as pin_memory asks: pageable memory would make every copy
    synchronous and staged through a driver buffer."""
    for run in offload_runs["runs"][name]:
        host = run["memory_by_tier"]["host"]
        assert run["pinned"] >= host["grads"] + host["params"] > 0, (run["pinned"], host)


def test_swap_files_are_private_to_the_run(offload_runs):
    assert offload_runs["left_in_swap"] == []
