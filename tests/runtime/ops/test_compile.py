"""The apply stage's compile slot through the engine: torch.compile per block, fused kernels
and block-sparse attention, each equal to eager single-process training (C19, C20).

Inductor's CPU backend compiles slowly (tens of seconds per graph on a shared 2-core
machine), so there are two Inductor runs, on the tiny GPT; the rewrites are checked with
their eager kernel bodies.
"""

import pytest
import torch
from torch import nn

from shardwise.runtime.compile import CompilePolicy, compile_blocks, find_blocks, traceable_hook
from shardwise.tools.testing import run_distributed
from tests.runtime.ops.compile_workers import train_counting_graphs
from tests.runtime.zero.workers import Case, assert_matches_reference, build_model, train_reference

COMPILED = {"compile": {"enabled": True, "backend": "inductor"}}
# Compiled and fused kernels sum in another order than eager torch (gradients differ by
# ~3e-7 relative); Adam turns such noise in near-zero gradient entries into steps of size
# lr, hence a smaller lr than the ZeRO tests' 1e-2, whose arithmetic is the same element
# by element.
LR = 1e-3


@pytest.mark.parametrize("stage", [0, 3])
def test_compiled_blocks_train_like_eager_at_zero_stages_with_one_graph_and_no_break(stage):
    case = Case(stage=stage, steps=3, lr=LR, extra_config={
        **COMPILED, "zero_optimization": {"stage3_param_persistence_threshold": 0},
    })
    results = run_distributed(train_counting_graphs, 2, case, timeout=600)
    expected = train_reference(Case(stage=stage, steps=3, lr=LR), 2)
    for result in results:
        assert_matches_reference(result, expected, 1e-5)
        assert result["graph_breaks"] == 0
        # Both blocks run one graph; nothing is compiled again after the first step.
        assert result["graphs_after_first_step"] == result["graphs"] == 1


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_fused_kernels_and_sparse_attention_train_like_the_original_model_at_stage_3(model):
    """A dense layout makes block-sparse attention compute exactly dense causal attention,
    so the rewritten model must train like the original one."""
    rewrites = {"compile": {"fused_ops": True}, "sparse_attention": {"mode": "dense", "block": 4},
                "zero_optimization": {"stage3_param_persistence_threshold": 0}}
    case = Case(stage=3, steps=2, model=model, lr=LR, extra_config=rewrites)
    results = run_distributed(train_counting_graphs, 2, case, eager_kernels=True, timeout=300)
    expected = train_reference(Case(stage=3, steps=2, model=model, lr=LR), 2)
    fused = {"gpt": {"FusedLayerNorm", "FusedGPTMLP", "FusedLMHead", "SparseCausalSelfAttention"},
             "llama": {"FusedRMSNorm", "FusedSwiGLUMLP", "SparseSelfAttention"}}[model]
    for result in results:
        assert fused <= set(result["modules"])
        assert_matches_reference(result, expected, 1e-5)


def test_blocks_are_found_in_gpt_and_hugging_face_models():
    assert len(find_blocks(build_model("gpt"))) == 2
    assert [type(b).__name__ for b in find_blocks(build_model("llama"))] == ["LlamaDecoderLayer"] * 2
    with pytest.raises(ValueError, match="found no repeated blocks"):
        compile_blocks(nn.Linear(2, 2), CompilePolicy(enabled=True, backend="eager"))


def test_a_hook_that_replaces_a_value_inside_a_compiled_block_is_refused():
    model = build_model("gpt")
    compile_blocks(model, CompilePolicy(enabled=True, backend="eager"))
    model.blocks[0].ln_1.register_forward_hook(lambda module, args, output: output * 2)
    with pytest.raises(RuntimeError, match="returns a replacement value"):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_hooks_inside_a_compiled_block_run_at_its_boundary_in_order():
    model = build_model("gpt")
    compile_blocks(model, CompilePolicy(enabled=True, backend="eager"))
    seen = []
    for name in ("ln_1", "attn.qkv", "mlp.fc"):
        module = model.blocks[0].get_submodule(name)
        module.register_forward_pre_hook(lambda m, args, name=name: seen.append(("pre", name)))
        module.register_forward_hook(lambda m, args, out, name=name: seen.append(("post", name, out.shape)))
    model(torch.zeros(1, 4, dtype=torch.long))
    block_output = (1, 4, 32)
    assert seen == [("pre", "ln_1"), ("pre", "attn.qkv"), ("pre", "mlp.fc"),
                    ("post", "mlp.fc", block_output), ("post", "attn.qkv", block_output),
                    ("post", "ln_1", block_output)]


def test_a_traceable_hook_stays_on_its_module_and_may_replace_its_input():
    """Tensor parallelism's region entry is such a hook (a replacement input, traced)."""
    model, reference = build_model("gpt"), build_model("gpt")
    for m in (model, reference):
        m.blocks[0].mlp.fc.register_forward_pre_hook(traceable_hook(lambda module, args: (args[0] * 2,)))
    compile_blocks(model, CompilePolicy(enabled=True, backend="eager"))
    tokens = torch.arange(8).view(2, 4)
    assert torch.equal(model(tokens), reference(tokens))
