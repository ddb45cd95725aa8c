"""torch.compile per block with Inductor on CUDA (Triton kernels), and the fused operators
compiled on their own, through the engine (C19, C20), each equal to the eager fp32 CPU
reference (tests/runtime/ops/test_compile.py's cases and worker, `train_counting_graphs`).

Inductor's Triton kernels sum in another order than eager torch (about 1e-7 relative);
Adam at lr 1e-3 keeps that below 1e-5, as on CPU. The CPU rehearsal compiles with
"aot_eager" and runs the fused bodies eagerly: Inductor's CPU code generation takes minutes
on a small machine and is covered by the CPU suite's slow tests.
"""

from tests.gpu.target import LR, ON_CUDA, WORLD, needs_target, run_ranks
from tests.runtime.ops.compile_workers import train_counting_graphs
from tests.runtime.zero.workers import Case, assert_matches_reference, train_reference

pytestmark = needs_target

BACKEND = "inductor" if ON_CUDA else "aot_eager"
ZERO3 = {"stage3_param_persistence_threshold": 0}


def test_compiled_blocks_train_like_eager_with_one_graph_and_no_break():
    """ZeRO-3 with full recomputation: the gathers at each block's boundary and the
    recomputation both run around the one compiled graph."""
    extra = {"compile": {"enabled": True, "backend": BACKEND}, "zero_optimization": ZERO3,
             "activation_checkpointing": {"policy": "full"}}
    results = run_ranks(train_counting_graphs, Case(stage=3, steps=3, lr=LR, extra_config=extra), timeout=280)
    expected = train_reference(Case(stage=3, steps=3, lr=LR), WORLD)
    for result in results:
        assert_matches_reference(result, expected, 1e-5)
        assert result["graph_breaks"] == 0
        # both blocks run one graph, in forward and in the recomputation; none compiled after step 1
        assert result["graphs_after_first_step"] == result["graphs"] == 1


def test_fused_kernels_and_sparse_attention_train_like_the_original_model():
    """Fused norm, MLP and output-layer bodies compiled to Triton kernels, and block-sparse
    attention (flex attention on CUDA) with a dense layout, which computes exactly dense
    causal attention: the rewritten model must train like the original one. (Not the
    tests/ops Llama: its head dimension 8 is below flex attention's CUDA minimum of 16,
    which test_sparse_attention_cuda.py checks on its own.)"""
    rewrites = {"compile": {"fused_ops": True}, "sparse_attention": {"mode": "dense", "block": 4},
                "zero_optimization": ZERO3}
    case = Case(stage=3, steps=2, lr=LR, extra_config=rewrites)
    results = run_ranks(train_counting_graphs, case, eager_kernels=not ON_CUDA, timeout=280)
    expected = train_reference(Case(stage=3, steps=2, lr=LR), WORLD)
    for result in results:
        assert {"FusedLayerNorm", "FusedGPTMLP", "FusedLMHead", "SparseCausalSelfAttention"} <= set(result["modules"])
        assert_matches_reference(result, expected, 1e-5)
