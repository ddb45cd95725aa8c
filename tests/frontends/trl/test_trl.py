"""TRL's trainers train on shardwise as they do on their own (C27).

A random-init tiny Llama with synthetic data is trained by each TRL trainer as TRL ships
it, in one process (the reference), and by the class `shardwise_trainer` makes of it, on
2 ranks with a ZeRO config (accumulation 2, gradient clipping, weight decay, a decaying
learning rate, the same global batches): every number logged at every step (loss, grad
norm, learning rate, DPO's rewards, log-probabilities and logits, SFT's entropy and token
counts) equals the reference's (fp32, relative error < 1e-5). DPO's reference model is a
forward-only engine at the trained model's stage, and its log-probabilities equal those
of the plain reference model.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl", reason="the TRL trainers need the trl extra: pip install 'shardwise[trl]'")

import shardwise.frontends.trl.trainers  # noqa: E402,F401  (preloaded by the ranks' fork server)
from shardwise.tools.testing import run_distributed  # noqa: E402
from tests.frontends.trl.workers import DISCONTINUOUS, NOT_COMPARED, Run, train_reference, train_shardwise  # noqa: E402

TOLERANCE = 1e-5
DPO_BETA = 0.1  # DPOConfig's default, which workers.py keeps


def close(a: float, b: float, scale: float = 0.0) -> bool:
    """Equal to a relative TOLERANCE of the larger value, or of `scale` where the value is
    a difference of larger numbers (the rounding is then the terms', not the result's)."""
    return abs(a - b) <= TOLERANCE * max(abs(a), abs(b), scale, 1e-6)


def terms_scale(key: str, entry: dict) -> float:
    """DPO's rewards are beta (log p - log p_ref): a difference of two log-probabilities of
    about -25 each, whose rounding (it differs between CPUs' kernels) can make up a large
    part of a reward near 0. They are compared at the size of their terms."""
    if key in ("rewards/chosen", "rewards/rejected"):
        return DPO_BETA * 2 * abs(entry["logps/" + key.split("/")[1]])
    if key == "rewards/margins":
        return DPO_BETA * 2 * (abs(entry["logps/chosen"]) + abs(entry["logps/rejected"]))
    return 0.0


def assert_logs_match(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and len(want) >= 2, f"logged at steps {sorted(got)}, reference {sorted(want)}"
    for step, entry in want.items():
        assert got[step].keys() == entry.keys(), f"step {step}: logged {sorted(got[step])}, reference {sorted(entry)}"
        for key, value in entry.items():
            if key in NOT_COMPARED or key in DISCONTINUOUS:
                continue
            assert close(got[step][key], value, terms_scale(key, entry)), \
                f"step {step} {key}: {got[step][key]} vs reference {value}"


def train_both(tmp_path, trainer: str, stage: int) -> tuple[dict, list[dict]]:
    reference = run_distributed(train_reference, 1, Run(out_dir=str(tmp_path / "ref"), trainer=trainer),
                                timeout=240)[0]
    ranks = run_distributed(train_shardwise, 2, Run(out_dir=str(tmp_path / "sw"), trainer=trainer, stage=stage),
                            timeout=240)
    for rank in ranks:
        assert (rank["stage"], rank["world_size"]) == (stage, 2)
    return reference, ranks


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_sft_logs_equal_trl(tmp_path, stage):
    reference, ranks = train_both(tmp_path, "sft", stage)
    assert {"loss", "grad_norm", "learning_rate", "entropy", "num_tokens"} <= reference["logs"][1].keys()
    for rank in ranks:
        assert_logs_match(rank["logs"], reference["logs"])


@pytest.mark.parametrize("stage", [3, pytest.param(2, marks=pytest.mark.slow)])
def test_dpo_logs_and_reference_log_probs_equal_trl(tmp_path, stage):
    reference, ranks = train_both(tmp_path, "dpo", stage)
    assert {"rewards/chosen", "rewards/margins", "logps/chosen", "logits/rejected"} <= reference["logs"][1].keys()
    for rank in ranks:
        assert rank["ref_is_engine"] == "ConfiguredEngine"  # forward-only, partitioned at stage 3
        for got, want in zip(rank["ref_logps_before"], reference["ref_logps_before"], strict=True):
            assert all(close(a, b) for a, b in zip(got.tolist(), want.tolist(), strict=True)), (got, want)
        assert_logs_match(rank["logs"], reference["logs"])


def test_reward_logs_equal_trl(tmp_path):
    reference, ranks = train_both(tmp_path, "reward", 2)
    for rank in ranks:
        assert_logs_match(rank["logs"], reference["logs"])
