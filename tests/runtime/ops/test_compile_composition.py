"""torch.compile per block together with ZeRO-3's gathers, activation checkpointing and
tensor parallelism (C19): one graph for both blocks, no graph break, nothing compiled again
after the first step, and training equal to eager single-process training.

The default suite compiles with "aot_eager": Dynamo and AOTAutograd capture, partition and
run the graph as for Inductor (graph breaks and recompilations are theirs), without
Inductor's code generation, which takes tens of seconds per graph on a loaded 2-core
machine; its arithmetic is eager's, so results are equal to the last bit. The Inductor
runs, and Llama under tensor parallelism, are marked slow.
"""

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from torch._dynamo.testing import CompileCounterWithBackend

from shardwise.runtime.activation.apply import apply_activation_checkpointing
from shardwise.runtime.compile import CompilePolicy, compile_blocks
from shardwise.tools.testing import run_distributed
from shardwise.runtime.base.torch_compat import SELECTIVE_POLICY_SEES_OUTPUT
from tests.runtime.ops.compile_workers import train_counting_graphs
from tests.runtime.parallel import workers as parallel_workers
from tests.runtime.zero.workers import Case, assert_matches_reference, build_model, global_batch, train_reference

# Inductor sums in another order than eager (see test_compile.py): Adam at a small lr.
LR = 1e-3
ZERO3 = {"stage3_param_persistence_threshold": 0}


def compiled(backend: str, **blocks) -> dict:
    return {"compile": {"enabled": True, "backend": backend}, **blocks}


def assert_one_graph_without_breaks(result: dict) -> None:
    assert result["graph_breaks"] == 0
    # Both blocks run one graph, in forward and in the recomputation; nothing is compiled
    # again after the first step.
    assert result["graphs_after_first_step"] == result["graphs"] == 1


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("policy", ["full", pytest.param("selective", marks=pytest.mark.skipif(
    not SELECTIVE_POLICY_SEES_OUTPUT, reason="compiled blocks under selective checkpointing need torch 2.12"))])
def test_compiled_blocks_with_zero3_and_recomputation_train_like_eager(policy, backend):
    extra = compiled(backend, zero_optimization=ZERO3, activation_checkpointing={"policy": policy})
    results = run_distributed(train_counting_graphs, 2, Case(stage=3, steps=3, lr=LR, extra_config=extra),
                              timeout=600)
    expected = train_reference(Case(stage=3, steps=3, lr=LR), 2)
    for result in results:
        assert_matches_reference(result, expected, 1e-5)
        assert_one_graph_without_breaks(result)


@pytest.mark.parametrize("model, backend", [("gpt", "aot_eager"), pytest.param("llama", "aot_eager", marks=pytest.mark.slow),
                                            pytest.param("gpt", "inductor", marks=pytest.mark.slow)])
def test_compiled_tensor_parallel_blocks_train_like_eager(model, backend):
    """TP=2 with ZeRO-1: the region collectives run inside the graph as opaque operators;
    Llama's attention and MLP enter the region in a pre-hook, traced with the block."""
    case = parallel_workers.parallel_case(stage=1, tensor=2, steps=3, model=model)
    case = Case(**{**case.__dict__, "extra_config": {**case.extra_config, **compiled(backend)}})
    results = run_distributed(train_counting_graphs, 2, case, tensor_parallel=True, timeout=600)
    parallel_workers.assert_equivalent(results, parallel_workers.train_reference(case, 1))
    for result in results:
        assert_one_graph_without_breaks(result)


@pytest.mark.parametrize("policy", ["every_k", "sqrt"])
def test_compiled_blocks_inside_multi_layer_and_every_kth_regions_give_eager_gradients(policy):
    """One process: a √n region runs both blocks (the second through its follower), every_k
    leaves the second block outside any region; each block still runs the one graph."""
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    reference, model = build_model("gpt"), build_model("gpt")
    apply_activation_checkpointing(model, policy)
    counter = CompileCounterWithBackend("aot_eager")
    compile_blocks(model, CompilePolicy(enabled=True, backend=counter))
    for step in range(2):
        x, y = global_batch(step, 4)
        reference(x, y).backward()
        model(x, y).backward()
    for (name, want), got in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(got.grad, want.grad), name
    assert counter.frame_count == 1 and sum(dynamo_utils.counters["graph_break"].values()) == 0
