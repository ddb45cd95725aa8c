"""An `Accelerator` script launched for DeepSpeed runs on shardwise with only the launch
changed (C27).

`scripts/clm_no_trainer.py` (the shape of Hugging Face's `run_clm_no_trainer.py`) is run
as a user launches it with accelerate's DeepSpeed plugin (`ACCELERATE_USE_DEEPSPEED`,
`ACCELERATE_DEEPSPEED_CONFIG_FILE`), under `shardwise run --as-deepspeed`, and as the same
user runs it with accelerate's DDP on CPUs (`ACCELERATE_USE_CPU`): on 2 ranks, every
rank's loss at every micro-batch is the same (fp32, relative error < 1e-5), across
accumulation windows, the short window at an epoch's end and `save_state`; resuming with
`load_state` continues the same losses.

The schedule is constant because accelerate steps a prepared scheduler once per process
per update under DDP and once per update under DeepSpeed (its DeepSpeedSchedulerWrapper),
so a decaying schedule differs between those two launches by accelerate's own design.
The config sets `gradient_clipping` to 0: the DDP script does not clip, and a config
without the key clips at 1.0, as DeepSpeed 0.19.8 does.

The DDP reference is a plain accelerate script under `shardwise run`: without the
launcher's guard (shardwise/tools/launcher/destroyed_groups.py), 4 runs in 15 on a loaded
2-core machine never exited, in a deadlock of torch 2.13's own (DDP's Reducer frees the
gloo process group with the GIL held while a gloo thread needs the GIL to free a finished
work); that file says how and why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate", reason="the accelerate tests need the transformers extra")

SCRIPTS = Path(__file__).resolve().parent / "scripts"
SCRIPT_ARGS = ["--lr_scheduler_type", "constant", "--samples", "20", "--per_device_train_batch_size", "2",
               "--gradient_accumulation_steps", "2", "--num_train_epochs", "2"]
TOLERANCE = 1e-5


def _launch(tmp_path: Path, name: str, *args: str, deepspeed_config: dict | None = None,
            accelerate_environment: dict[str, str] | None = None) -> list[list[float]]:
    """The script on 2 ranks: accelerate's DDP when `deepspeed_config` is None, else
    accelerate's DeepSpeed plugin with that config, on shardwise; every rank's losses.
    `accelerate_environment`: more of accelerate's settings, as `accelerate launch` sets them."""
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not key.startswith("ACCELERATE_")}
    environment["OMP_NUM_THREADS"] = "1"
    environment.update(accelerate_environment or {})
    command = [sys.executable, "-m", "shardwise.tools.cli.main", "run"]
    if deepspeed_config is None:
        environment["ACCELERATE_USE_CPU"] = "true"
        command += ["--nproc", "2", str(SCRIPTS / "clm_no_trainer.py")]
    else:
        config_file = tmp_path / f"{name}.ds.json"
        config_file.write_text(json.dumps(deepspeed_config))
        environment.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_CONFIG_FILE=str(config_file))
        command += ["--as-deepspeed", "--no-local-rank", "--nproc", "2", str(SCRIPTS / "gloo_for_nccl.py"),
                    str(SCRIPTS / "clm_no_trainer.py")]
    prefix = tmp_path / name
    try:
        result = subprocess.run([*command, *SCRIPT_ARGS, "--losses", str(prefix), *args], capture_output=True,
                                text=True, timeout=240, env=environment)
    except subprocess.TimeoutExpired as timeout:  # before pytest's own timeout, so the output is seen
        stderr = (timeout.stderr or b"").decode(errors="replace")  # bytes even with text=True
        pytest.fail(f"{name} did not finish in {timeout.timeout:g}s:\n{stderr[-6000:]}")
    assert result.returncode == 0, f"{name} exited with {result.returncode}:\n{result.stderr[-6000:]}"
    return [json.loads(Path(f"{prefix}.rank{rank}.json").read_text()) for rank in range(2)]


def _assert_equal(run: list[list[float]], reference: list[list[float]]) -> None:
    for rank, (losses, expected) in enumerate(zip(run, reference)):
        assert len(losses) == len(expected) > 0, f"rank {rank}: {len(losses)} losses, reference {len(expected)}"
        for step, (value, want) in enumerate(zip(losses, expected)):
            error = abs(value - want) / abs(want)
            assert error < TOLERANCE, f"rank {rank} micro-batch {step}: {value} vs {want} ({error:.1e})"


def _zero(stage: int) -> dict:
    """At stage 3 with `stage3_gather_16bit_weights_on_model_save`, which accelerate's
    `get_state_dict` requires there."""
    zero = {"stage": stage, **({"stage3_gather_16bit_weights_on_model_save": True} if stage == 3 else {})}
    return {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
            "gradient_clipping": 0.0}  # the DDP script does not clip; DeepSpeed 0.19.8 clips at 1.0 without the key


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> tuple[list[list[float]], dict]:
    """DDP's losses and its final `accelerator.get_state_dict(model)`."""
    directory = tmp_path_factory.mktemp("ddp")
    losses = _launch(directory, "ddp", "--state_dict", str(directory / "state.json"))
    return losses, json.loads((directory / "state.json").read_text())


@pytest.fixture(scope="module")
def ddp_losses(ddp_run) -> list[list[float]]:
    return ddp_run[0]


@pytest.mark.parametrize("stage", [3, pytest.param(2, marks=pytest.mark.slow)])
def test_accelerate_deepspeed_script_losses_equal_ddp(tmp_path, ddp_run, stage):
    """Also `accelerator.get_state_dict(model)`: DDP's weights, each tensor holding only
    its own elements. Below ZeRO-3 accelerate clones them with
    deepspeed.checkpoint.utils.clone_tensors_for_torch_save; at ZeRO-3 it asks the engine's
    `_zero3_consolidated_16bit_state_dict()` to gather them onto rank 0."""
    ddp_losses, ddp_state = ddp_run
    losses = _launch(tmp_path, "shardwise", "--output_dir", str(tmp_path / "out"), "--checkpointing_steps", "2",
                     "--state_dict", str(tmp_path / "state.json"), deepspeed_config=_zero(stage))
    assert [len(rank) for rank in losses] == [10, 10]  # 5 micro-batches an epoch: windows of 2, 2 and 1
    _assert_equal(losses, ddp_losses)
    saved = tmp_path / "out" / "step_4"
    assert (saved / "pytorch_model" / "manifest.json").is_file()  # the engine's checkpoint, through save_state
    assert (saved / "latest").read_text().strip() == "pytorch_model"
    state = json.loads((tmp_path / "state.json").read_text())
    assert state.keys() == ddp_state.keys()
    for name, (values, owns_storage) in state.items():
        want = torch.tensor(ddp_state[name][0])
        assert owns_storage, f"{name} is a view: torch.save would write its whole buffer"
        assert (torch.tensor(values) - want).norm() <= TOLERANCE * want.norm(), name


@pytest.mark.slow  # the default run: engine.compile(backend, compile_kwargs) in tests/frontends/deepspeed/api
def test_accelerate_dynamo_backend_compiles_the_engine(tmp_path, ddp_losses):
    """`dynamo_backend` with the DeepSpeed plugin: accelerate calls
    `engine.compile(backend=..., compile_kwargs=...)` after initialize (it raised before
    shardwise's engine had DeepSpeed's compile); backend "eager" traces with Dynamo, so
    the losses stay DDP's."""
    losses = _launch(tmp_path, "compiled", "--compiled", str(tmp_path / "compiled.json"), deepspeed_config=_zero(3),
                     accelerate_environment={"ACCELERATE_DYNAMO_BACKEND": "eager",
                                             "ACCELERATE_DYNAMO_USE_DYNAMIC": "false"})
    _assert_equal(losses, ddp_losses)
    assert json.loads((tmp_path / "compiled.json").read_text()) is True


@pytest.mark.slow
def test_accelerate_load_state_resumes_the_same_losses(tmp_path, ddp_losses):
    out = tmp_path / "out"
    _launch(tmp_path, "first", "--output_dir", str(out), "--checkpointing_steps", "4", deepspeed_config=_zero(3))
    resumed = _launch(tmp_path, "resumed", "--output_dir", str(out), "--resume_from_checkpoint", str(out / "step_4"),
                      deepspeed_config=_zero(3))
    # step 4 ends epoch 2's first window (epoch 1 has 3 updates): 7 micro-batches done, 3 left
    _assert_equal(resumed, [rank[7:] for rank in ddp_losses])
