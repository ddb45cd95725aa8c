"""TRL's SFT, DPO and GRPO trainers as TRL ships them, their DeepSpeed config in
`TrainingArguments(deepspeed=...)`, run unchanged under `shardwise run --as-deepspeed` on 2
ranks at ZeRO-3 (scripts/stock_trl.py, scripts/stock_grpo.py): every logged number equals
TRL's own single-process run's (as in test_trl.py), and GRPO's completions and logs its
DDP run's (as in test_grpo.py). GRPO generates inside TRL's `unwrap_model_for_generation`,
which removes DeepSpeed's stage-3 hooks through `optimizer.parameter_offload` and puts
them back (an AttributeError before).

At ZeRO-3, TRL's chunked log-probability kernel saves the LM head's weight and, in its
backward, reads the saved parameter's `ds_status` to gather it. Under any saved-tensor
hook torch hands a backward aliases, not the saved parameters, so `deepspeed.initialize`
counts no saved activations at stage 3 (ActivationPolicy.count_saved); with the hook on,
this backward raised an AttributeError.

The launches go through the accelerate tests' gloo_for_nccl.py: on a machine without
GPUs accelerate gives a DeepSpeed launch no process group (with DeepSpeed itself too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="the TRL trainers need the trl extra: pip install 'shardwise[trl]'")

from shardwise.tools.testing import run_distributed  # noqa: E402
from tests.frontends.accelerate.deepspeed_launch import launch_as_deepspeed  # noqa: E402
from tests.frontends.trl.grpo_workers import WORLD, GrpoRun, save_policy  # noqa: E402
from tests.frontends.trl.grpo_workers import train_reference as grpo_reference  # noqa: E402
from tests.frontends.trl.test_grpo import close  # noqa: E402
from tests.frontends.trl.grpo_workers import DISCONTINUOUS as GRPO_DISCONTINUOUS  # noqa: E402
from tests.frontends.trl.grpo_workers import NOT_COMPARED as GRPO_NOT_COMPARED  # noqa: E402
from tests.frontends.trl.test_trl import assert_logs_match  # noqa: E402
from tests.frontends.trl.workers import Run, train_reference  # noqa: E402

HERE = Path(__file__).resolve().parent


def _stock(tmp_path: Path, script: str, *args: str) -> Path:
    """`script` on 2 ranks under --as-deepspeed; its output folder (its last argument)."""
    launch_as_deepspeed(HERE / "scripts" / script, *args)
    return Path(args[-1])


def _steps(logs: dict) -> dict:
    return {int(step): entry for step, entry in logs.items()}


@pytest.mark.slow  # the default run: test_saved_parameters.py (tests/frontends/deepspeed/api)
@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_stock_trainer_at_zero3_logs_trls_numbers(tmp_path, kind):
    reference = run_distributed(train_reference, 1, Run(out_dir=str(tmp_path / "ref"), trainer=kind),
                                timeout=240)[0]
    out = _stock(tmp_path, "stock_trl.py", kind, "3", str(tmp_path / kind))
    assert_logs_match(_steps(json.loads((out / "logs.json").read_text())), reference["logs"])


@pytest.mark.slow  # the default run: TRL's remove_hooks / add_hooks in tests/frontends/deepspeed/api
def test_stock_grpo_at_zero3_generates_and_logs_as_trl_under_ddp(tmp_path):
    save_policy(str(tmp_path / "policy"))
    reference = run_distributed(grpo_reference, WORLD, GrpoRun(out_dir=str(tmp_path / "ref"),
                                                               model_dir=str(tmp_path / "policy")), timeout=240)[0]
    out = _stock(tmp_path, "stock_grpo.py", str(tmp_path / "policy"), "3", str(tmp_path / "grpo"))
    got = json.loads((out / "logs.json").read_text())
    assert got["completions"] == reference["completions"]
    logs = _steps(got["logs"])
    assert sorted(logs) == sorted(reference["logs"])
    for step, entry in reference["logs"].items():
        assert logs[step].keys() == entry.keys()
        for key, value in entry.items():
            if key not in GRPO_NOT_COMPARED and key not in GRPO_DISCONTINUOUS:
                assert close(logs[step][key], value), f"step {step} {key}: {logs[step][key]} vs {value}"
