"""Checkpoints on CUDA (C8): a run saved after 2 of 4 steps and resumed continues as the
uninterrupted run does, with the device's random generator, the loss scaler and offloaded
(pinned) optimizer state restored; a checkpoint saved on CUDA resumes on a machine without
a GPU. The runs are tests/checkpoint's (`train_run`), saved and resumed in one launch.

CUDA kernels that accumulate with atomics (attention's backward among them) are not
bitwise reproducible from run to run, so where the CPU suite asserts bit equality these
compare at fp32's 1e-5, and the 16-bit cases at 2e-2 (see target.py's TOLERANCE); the
random draws, step counters, learning rate and loss scaler state must be exact.
"""

import pytest

from shardwise.tools.testing import run_distributed
from tests.runtime.checkpoint.workers import KEEP_SMALL_WHOLE, Run, train_run
from tests.gpu.target import DEVICE, LR, WORLD, needs_target, run_ranks
from tests.runtime.zero.workers import Case, relative_error

pytestmark = needs_target

ROWS = 4
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-2}
WARMUP = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}}}
OFFLOADED = {"zero_optimization": {"stage3_param_persistence_threshold": 0,
                                   "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                   "offload_param": {"device": "cpu", "pin_memory": True}}}
CASES = {
    "s3-fp32": Case(stage=3, lr=LR, extra_config={**KEEP_SMALL_WHOLE, **WARMUP}),
    "s2-bf16": Case(stage=2, dtype="bf16", lr=LR, extra_config=WARMUP),
    "s1-fp16": Case(stage=1, dtype="fp16", lr=LR, extra_config={"fp16": {"initial_scale_power": 8}}),
    "s3-offloaded-pinned": Case(stage=3, model="gpt-untied", lr=LR, extra_config=OFFLOADED),
}


def save_and_resume(rank: int, world_size: int, directories: dict[str, str]) -> dict:
    """Per case: 4 steps saving after 2, then a fresh engine loading that and training 2."""
    runs = {}
    for name, case in CASES.items():
        uninterrupted = train_run(rank, world_size, Run(case, rows=ROWS, steps=4, save_dir=directories[name],
                                                        save_after=2, client_state={"case": name}))
        resumed = train_run(rank, world_size, Run(case, rows=ROWS, first_step=2, load_dir=directories[name]))
        runs[name] = {"uninterrupted": uninterrupted, "resumed": resumed}
    return runs


@pytest.fixture(scope="module")
def directories(tmp_path_factory) -> dict[str, str]:
    return {name: str(tmp_path_factory.mktemp(name)) for name in CASES}


@pytest.fixture(scope="module")
def resumed_runs(directories) -> list[dict]:
    return run_ranks(save_and_resume, directories, timeout=280)


def assert_close(got: dict, want: dict, tolerance: float) -> None:
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        assert abs(a - b) / abs(b) < tolerance, f"step {step}: loss {a} vs {b}"
    for name, tensor in want["params"].items():
        assert relative_error(got["params"][name], tensor) < tolerance, name


@pytest.mark.parametrize("name", list(CASES))
def test_resume_continues_the_run(name, resumed_runs):
    dtype = CASES[name].dtype
    for rank_runs in resumed_runs:
        uninterrupted, resumed = rank_runs[name]["uninterrupted"], rank_runs[name]["resumed"]
        assert_close(resumed, {"losses": uninterrupted["losses"][2:], "params": uninterrupted["params"]},
                     TOLERANCE[dtype])
        assert resumed["client_state"] == {"case": name}
        assert resumed["global_steps"] == 4 and resumed["lr"] == uninterrupted["lr"]
        if dtype == "fp16":  # dynamic loss scaling: its scale and counters carry over
            assert resumed["loss_scaler"] == uninterrupted["loss_scaler"]
        # CPU, Python and NumPy generators, and on CUDA the device's (tests/runtime/checkpoint/workers.py)
        assert resumed["draws_after_load"] == uninterrupted["draws_after_save"]
        assert len(resumed["draws_after_load"]) == (4 if DEVICE == "cuda" else 3)


def test_a_checkpoint_saved_on_cuda_resumes_without_a_gpu(resumed_runs, directories):
    """The fp32 stage-3 checkpoint, loaded by gloo ranks that see no GPU."""
    name = "s3-fp32"
    on_cpu = run_distributed(train_run, WORLD, Run(CASES[name], rows=ROWS, first_step=2, load_dir=directories[name]),
                             env={"CUDA_VISIBLE_DEVICES": ""})
    for rank, resumed in enumerate(on_cpu):
        uninterrupted = resumed_runs[rank][name]["uninterrupted"]
        assert_close(resumed, {"losses": uninterrupted["losses"][2:], "params": uninterrupted["params"]}, 1e-5)
        assert resumed["draws_after_load"] == uninterrupted["draws_after_save"][:3]  # no device generator here
