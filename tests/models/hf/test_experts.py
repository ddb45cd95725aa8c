"""A Hugging Face Mixtral with its stacked experts spread over an expert-parallel group
(shardwise/models/hf/experts.py) trains exactly like one process on the same global batch
(fp32, losses and final weights < 1e-5 relative), the router's auxiliary loss included:
ep=2 on 2 ranks at ZeRO 0, 1 and 3, ep=2 x dp=2 on 4 ranks (the expert-data group), and
tp=2 x ep=2 (4 ranks, each kept expert's width split over the tensor group), and pp=2 x ep=2
(4 ranks) and pp=2 alone (2 ranks), the auxiliary loss carried across the stages.

The router picks experts by top-k, a discontinuous choice: as in test_decoders.py the
comparison is a 2-step trajectory of a tiny model whose router margins (~1e-2) are orders of
magnitude above the last-bit differences of the parallel sums.
"""

from functools import lru_cache

import pytest
import safetensors.torch

from shardwise.formulas.communication import dropless_exchange_bytes
from shardwise.models import plan_for
from shardwise.models.hf.decoders import DecoderAdapter, RouterLossDecoderAdapter
from shardwise.models.hf.experts import ExpertParallelStackedExperts
from shardwise.runtime.checkpoint.convert import convert_checkpoint
from shardwise.tools.testing import DistributedTestError, run_distributed
from tests.models.hf.expert_workers import (ExpertCase, build_mixtral, resume_at_another_expert_size, train_parallel,
                                           train_reference)
from tests.runtime.zero.workers import relative_error

TOLERANCE = 1e-5
HIDDEN = 32


@lru_cache(maxsize=None)
def reference(data_size: int, router_loss: bool = True, steps: int = 2) -> dict:
    return train_reference(ExpertCase(router_loss=router_loss, steps=steps), data_size)


def assert_matches(results: list[dict], want: dict) -> None:
    data_ranks = {result["data_rank"] for result in results}
    for step, expected in enumerate(want["losses"]):
        got = sum(next(r for r in results if r["data_rank"] == d)["losses"][step] for d in data_ranks) / len(data_ranks)
        assert abs(got - expected) / expected < TOLERANCE, f"step {step}: loss {got} vs {expected}"
    held = set()
    for result in results:
        held |= set(result["params"])
        for name, got in result["params"].items():
            error = relative_error(got, want["params"][name])
            assert error < TOLERANCE, f"{name}: relative error {error:.2e}"
    assert held == set(want["params"])


@pytest.mark.parametrize("stage", [0, pytest.param(1, marks=pytest.mark.slow), 3])
def test_ep2_matches_single_process_and_its_all_to_all_bytes_match_the_formula(stage):
    results = run_distributed(train_parallel, 2, ExpertCase(stage=stage))
    assert_matches(results, reference(2))
    for result in results:  # every layer call's exchange, forward and backward
        calls = zip(*(other["routed"] for other in sorted(results, key=lambda r: r["expert_rank"])))
        want = sum(dropless_exchange_bytes(list(routed), member=result["expert_rank"], hidden_size=HIDDEN,
                                           bytes_per_element=4) for routed in calls)
        assert result["bytes"] == {"all_to_all": want}


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 2])
def test_ep2_in_windows_the_caller_ends_matches_single_process(stage):
    """managed_gradient_accumulation false: one step() after each rank's two backward passes."""
    assert_matches(run_distributed(train_parallel, 2, ExpertCase(stage=stage, caller_ends_windows=True)), reference(2))


@pytest.mark.slow
def test_ep2_dp2_with_expert_optimizer_state_partitioned_matches_single_process():
    """4 ranks, 2 expert groups: each expert's gradient summed over the 2 ranks holding it
    and its optimizer state split between them (ZeRO 1)."""
    assert_matches(run_distributed(train_parallel, 4, ExpertCase(stage=1)), reference(4))


def test_tp2_ep2_matches_single_process():
    assert_matches(run_distributed(train_parallel, 4, ExpertCase(tensor=2)), reference(2))


@pytest.mark.slow
def test_pp2_ep2_matches_single_process():
    """4 ranks: 2 stages of one layer each, every stage's experts over its 2 data-parallel
    ranks, the router's auxiliary loss over both stages' routers carried to the last."""
    results = run_distributed(train_parallel, 4, ExpertCase(pipeline=2))
    assert set(results[0]["params"]) != set(results[-1]["params"])  # each stage keeps its own layers
    assert_matches(results, reference(2))


def test_pp2_adds_the_router_loss_of_every_stage_as_one_process():
    """Without expert parallelism too: the stages carry the auxiliary loss's sums."""
    assert_matches(run_distributed(train_parallel, 2, ExpertCase(expert=1, pipeline=2)), reference(1))


def test_pipeline_stages_carry_the_router_loss_only_when_the_model_adds_it():
    assert type(plan_for(build_mixtral(router_loss=True)).pipeline) is RouterLossDecoderAdapter
    assert type(plan_for(build_mixtral(router_loss=False)).pipeline) is DecoderAdapter


def _initialize_with_whole_experts(rank: int, world_size: int) -> None:
    import shardwise
    from tests.models.hf.expert_workers import make_optimizer

    model = build_mixtral()
    config = {**ExpertCase(tensor=2).config(), "tensor_parallel": {"size": 2, "plan": {"lm_head": "vocab_head"}}}
    shardwise.initialize(model, config, optimizer=make_optimizer(model, 0.1))


@pytest.mark.slow
def test_tensor_parallelism_refuses_experts_it_does_not_split():
    """A tensor plan that leaves the experts whole would count their gradient once per
    tensor rank: refused with the reason."""
    with pytest.raises(DistributedTestError, match=r"needs experts split by the tensor group"):
        run_distributed(_initialize_with_whole_experts, 4)


def test_an_expert_parallel_size_that_does_not_divide_the_experts_is_refused():
    experts = build_mixtral().model.layers[0].mlp.experts
    with pytest.raises(ValueError, match=r"autoep_size 3: .* has 4 experts .* do not split over 3 ranks"):
        ExpertParallelStackedExperts(experts, size=3, rank=0)



@pytest.mark.parametrize("saved, loaded, tensor", [(2, 1, 1), (1, 2, 1), pytest.param(2, 1, 2, marks=pytest.mark.slow)],
                         ids=["ep2-to-ep1", "ep1-to-ep2", "tp2-ep2-to-tp2-ep1"])
def test_checkpoint_resumes_at_another_expert_parallel_size(saved, loaded, tensor, tmp_path):
    """2 steps at one expert-parallel size, a checkpoint, 2 steps of a fresh engine at
    another (ep=1: every expert among the dense parameters, their momentum in ZeRO's store),
    on 2 ranks (4 with tp=2, each expert's width split too). Each rank's slice of the
    stacked experts is saved as its range of the stacked tensor (its tensor block as the
    runs of it), so the loader regroups values and momentum into whatever slice it holds:
    the steps after the load equal one process's 4 steps (fp32, 1e-5); saved at ep=2,
    `convert` exports the stacked tensors whole, equal to one process's after 2 steps."""
    saving = ExpertCase(expert=saved, tensor=tensor, stage=1)
    loading = ExpertCase(expert=loaded, tensor=tensor, stage=1, steps=4)
    want = reference(2, steps=4)["losses"][saving.steps:]
    results = run_distributed(resume_at_another_expert_size, 2 * tensor, saving, loading,
                              str(tmp_path / "checkpoint"))
    data = [losses for rank, losses in enumerate(results) if rank % tensor == 0]  # one rank per tensor group
    for step, expected in enumerate(want, start=saving.steps):
        got = sum(losses[step - saving.steps] for losses in data) / len(data)
        assert abs(got - expected) / expected < TOLERANCE, f"step {step}: loss {got} vs {expected}"
    if saved == 2 and tensor == 1:
        convert_checkpoint(tmp_path / "checkpoint", tmp_path / "model.safetensors")
        exported = safetensors.torch.load_file(tmp_path / "model.safetensors")
        after_two = reference(2)["params"]
        assert exported.keys() == after_two.keys()
        for name, weight in after_two.items():
            assert relative_error(exported[name], weight) < TOLERANCE, name
