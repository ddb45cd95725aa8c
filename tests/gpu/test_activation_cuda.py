"""CPU activation checkpointing on CUDA (ZeRO-R's CPU / Md, activation/store.py): each kept
layer input is copied to pinned host memory on a side stream and back for the
recomputation. A missing stream dependency or an early reuse of the source shows as
recomputed values that differ from the forward's; dropout checks that the recomputation
replays the CUDA generator. Each policy must train as no recomputation does (the CPU
suite's `train_policies`, tests/runtime/activation/workers.py), with a lower device peak."""

import pytest
import torch

from tests.runtime.activation.workers import train_policies
from tests.gpu.target import launch_once, needs_target, run_ranks

pytestmark = needs_target

TO_HOST = {"cpu_checkpointing": True}
# Md on the host: one pinned buffer, sized for 3 checkpoints up front
CONTIGUOUS_ON_HOST = {"cpu_checkpointing": True, "contiguous_memory_optimization": True, "number_checkpoints": 3}
SETTINGS = {"stage3": (3, ["none", "full", "selective"], TO_HOST),
            "stage2-contiguous": (2, ["none", "full", "every_k"], CONTIGUOUS_ON_HOST)}


def train_settings(rank: int, world_size: int) -> dict:
    return {name: train_policies(rank, world_size, stage, policies, extra={"activation_checkpointing": block})
            for name, (stage, policies, block) in SETTINGS.items()}


@launch_once
def policy_runs() -> list[dict]:
    return run_ranks(train_settings)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_host_checkpoints_train_like_no_recomputation(setting):
    _, policies, _ = SETTINGS[setting]
    for rank, result in enumerate(policy_runs()):
        reference = result[setting]["none"]
        for policy in policies[1:]:
            run = result[setting][policy]
            for got, want in zip(run["losses"], reference["losses"]):
                assert abs(got - want) / abs(want) < 1e-5, (rank, policy, got, want)
            for name, want in reference["params"].items():
                assert relative_error(run["params"][name], want) < 1e-5, (rank, policy, name)
            # 3 layers, 2 steps: every_k (k = 2) re-runs layers 0 and 2, the others all 3
            assert run["recomputed_layers"] == (4 if policy == "every_k" else 6), policy
            assert run["activations"]["checkpoints"] > 0, policy
            assert run["memory"]["activations"] < reference["memory"]["activations"], policy
