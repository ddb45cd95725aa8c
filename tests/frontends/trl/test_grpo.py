"""TRL's GRPOTrainer on shardwise (C27/C32): generation from a ZeRO-3 policy gathered
once per generation, group-relative advantages from a plain Python reward, the clipped
loss with a KL term to a forward-only reference engine.

The reference is TRL's own GRPOTrainer under plain DDP on the same 2 ranks (each rank
generates its own completions, so the runs compare rank by rank); grpo_workers.py says
how sampling is made deterministic. Every number TRL logs at every step equals the
reference's (fp32, relative error < 1e-5), the completions are the same tokens, and at
ZeRO-3 the policy's all-gather bytes during a generation are one gather of its
partitioned parameters (`generation_gather_bytes`), where generating outside that gather
costs one per token.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl", reason="the TRL trainers need the trl extra: pip install 'shardwise[trl]'")

import shardwise.frontends.trl.trainers  # noqa: E402,F401  (preloaded by the ranks' fork server)
from shardwise.formulas.communication import generation_gather_bytes  # noqa: E402
from shardwise.tools.testing import run_distributed  # noqa: E402
from tests.frontends.trl.grpo_workers import (  # noqa: E402
    DISCONTINUOUS,
    ITERATIONS,
    NOT_COMPARED,
    WORLD,
    GrpoRun,
    save_policy,
    train_reference,
    train_shardwise,
)

TOLERANCE = 1e-5
FP32_BYTES = 4


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(abs(a), abs(b), 1e-6)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Per stage, the reference's and shardwise's results, run once for the module's tests."""
    cache: dict[int, tuple[list[dict], list[dict]]] = {}

    def run(stage: int) -> tuple[list[dict], list[dict]]:
        if stage not in cache:
            folder = tmp_path_factory.mktemp(f"grpo_stage{stage}")
            save_policy(str(folder / "policy"))
            shared = {"model_dir": str(folder / "policy"), "stage": stage}
            reference = run_distributed(train_reference, WORLD, GrpoRun(out_dir=str(folder / "ref"), **shared),
                                        timeout=240)
            ranks = run_distributed(train_shardwise, WORLD, GrpoRun(out_dir=str(folder / "sw"), **shared),
                                    timeout=240)
            cache[stage] = reference, ranks
        return cache[stage]

    return run


def assert_runs_equal(reference: list[dict], ranks: list[dict], stage: int) -> None:
    for rank, (got, want) in enumerate(zip(ranks, reference, strict=True)):
        assert (got["stage"], got["world_size"]) == (stage, WORLD)
        assert got["ref_is_engine"] == "ConfiguredEngine"  # beta > 0: the reference is a forward-only engine
        assert len(want["completions"]) == 1 and got["completions"] == want["completions"], f"rank {rank} sampled"
        logs, expected = got["logs"], want["logs"]
        assert sorted(logs) == sorted(expected) == list(range(1, ITERATIONS + 1))
        assert {"loss", "grad_norm", "kl", "reward", "reward_std", "entropy"} <= expected[1].keys()
        for step, entry in expected.items():
            assert logs[step].keys() == entry.keys(), f"step {step}: {sorted(logs[step])} vs {sorted(entry)}"
            for key, value in entry.items():
                if key not in NOT_COMPARED and key not in DISCONTINUOUS:
                    assert close(logs[step][key], value), f"rank {rank} step {step} {key}: {logs[step][key]} vs {value}"
        assert expected[ITERATIONS]["kl"] > 0 and expected[ITERATIONS]["loss"] != 0  # the policy moved


def test_grpo_logs_equal_trl_ddp_at_zero3(runs):
    reference, ranks = runs(3)
    assert_runs_equal(reference, ranks, 3)


def test_zero3_generation_gathers_the_policy_once(runs):
    _, ranks = runs(3)
    for rank in ranks:
        once = generation_gather_bytes(rank["padded_params"], persistent_params=rank["persistent_params"],
                                       param_bytes=FP32_BYTES, shard_size=WORLD, gathers=1)
        assert once > 0 and rank["generation_gather_bytes"] == [once]
        # the count works: generating outside the block costs one gather of the policy per new token
        assert rank["per_token_gather_bytes"] == {tokens: generation_gather_bytes(
            rank["padded_params"], persistent_params=rank["persistent_params"], param_bytes=FP32_BYTES,
            shard_size=WORLD, gathers=tokens) for tokens in (1, 3)}
        assert max(len(ids) for ids in rank["completions"][0]) > 1  # so "once" is not also "per token"


@pytest.mark.slow
def test_grpo_logs_equal_trl_ddp_at_zero2(runs):
    reference, ranks = runs(2)
    assert_runs_equal(reference, ranks, 2)
    assert all(rank["generation_gather_bytes"] == [0] for rank in ranks)  # whole parameters: nothing to gather
