"""Every recomputation policy trains exactly as no recomputation, at ZeRO stages 0-3 on two
ranks, with dropout (the recomputation replays the RNG), through `initialize`'s config; and
the stage-3 gathers a recomputation needs are counted and cost no extra volume."""

import pytest
import torch

from shardwise.formulas.activation import LayerShape, checkpoint_bytes, selective_kept_bytes
from shardwise.tools.testing import run_distributed
from tests.runtime.activation.workers import train_policies
from tests.runtime.zero.workers import Case, assert_matches_reference, train_reference

POLICIES = ["none", "full", "every_k", "selective", "sqrt"]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_policy_equals_no_recomputation(stage):
    results = run_distributed(train_policies, 2, stage, POLICIES)
    for rank, result in enumerate(results):
        reference = result["none"]
        assert reference["recomputed_layers"] == 0
        for policy in POLICIES[1:]:
            run = result[policy]
            for got, want in zip(run["losses"], reference["losses"]):
                assert abs(got - want) / abs(want) < 1e-5, (rank, policy, got, want)
            for name, want in reference["params"].items():
                assert relative_error(run["params"][name], want) < 1e-5, (rank, policy, name)
            # 3 layers, 2 steps: full/selective/sqrt re-run all 3 each step, every_k layers 0 and 2
            assert run["recomputed_layers"] == (4 if policy == "every_k" else 6), policy
            assert run["activations"]["checkpoints"] > 0, policy
            assert run["memory"]["activations"] < reference["memory"]["activations"], policy


def test_stage3_recomputation_gathers_are_counted_and_add_no_volume():
    """The recomputation gathers each checkpointed layer's units; backward then uses them
    without a second gather, so the all-gather volume is exactly no recomputation's (docs/formulas.md#recomputation-under-zero-3)."""
    (result, _) = run_distributed(train_policies, 2, 3, ["none", "full", "every_k"])
    assert result["none"]["recompute_gathers"] == 0
    # 6 units per layer (ln_1, qkv, attention proj, ln_2, fc, MLP proj): 3 layers, 2 steps;
    # every_k with k = 2 re-runs layers 0 and 2
    assert result["full"]["recompute_gathers"] == 6 * 3 * 2
    assert result["every_k"]["recompute_gathers"] == 6 * 2 * 2
    assert result["full"]["comm"]["all_gather"] == result["none"]["comm"]["all_gather"]
    assert result["full"]["comm"]["reduce_scatter"] == result["none"]["comm"]["reduce_scatter"]


def test_full_recomputation_matches_single_process_reference():
    """Without dropout, the 2-rank stage-2 run with full recomputation equals plain PyTorch
    on the whole batch (the project's reference)."""
    extra = {"activation_checkpointing": {"policy": "full"}}
    case = Case(stage=2, steps=2, extra_config=extra)
    from tests.runtime.zero.workers import train_parallel

    result = run_distributed(train_parallel, 2, case)[0]
    assert_matches_reference(result, train_reference(case, 2), 1e-5)


def test_stage3_keeps_units_a_finished_recomputation_used():
    """Without dropout a block ends in a residual add, so its MLP projection is gathered for
    backward before the recomputation runs; a recomputation that runs to the end (early stop
    off) passes that module again, and must not release the unit under its backward."""
    results = run_distributed(train_policies, 2, 3, ["none", "full"], dropout=0.0, early_stop=False)
    for result in results:
        for name, want in result["none"]["params"].items():
            assert relative_error(result["full"]["params"][name], want) < 1e-5, name


def test_partitioned_checkpoints_under_tensor_parallelism():
    """TP = 2 (Megatron-style GPT layers): with every policy each rank keeps half of every
    kept layer input (the inputs are replicated over the tensor group), selective also its
    linear outputs (column-parallel halves, row-parallel partial sums whole), and training
    equals no recomputation."""
    extra = {"tensor_parallel": {"size": 2}, "activation_checkpointing": {"partition_activations": True}}
    layer = LayerShape(16, 2, 32, 2, element_bytes=4, tensor_parallel=2)
    regions = {"full": 3, "every_k": 2, "selective": 3, "sqrt": 2}  # 3 layers; k = 2; ⌈√3⌉ = 2 per segment
    for result in run_distributed(train_policies, 2, 1, POLICIES, extra=extra):
        for policy, count in regions.items():
            run = result[policy]
            for got, want in zip(run["losses"], result["none"]["losses"]):
                assert abs(got - want) / abs(want) < 1e-5, policy
            for name, want in result["none"]["params"].items():
                assert relative_error(run["params"][name], want) < 1e-5, (policy, name)
            kept = count * checkpoint_bytes(layer, partitioned=True)
            if policy == "selective":
                kept += 3 * selective_kept_bytes(layer)
            assert run["activations"]["checkpoints"] == kept, policy
