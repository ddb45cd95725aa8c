"""The `compile` and `sparse_attention` config blocks: shardwise's and DeepSpeed's spellings,
and errors that name the key, the reason and the fix."""

import logging

import pytest

from shardwise.frontends.deepspeed.config import ConfigError, load_config
from shardwise.frontends.deepspeed.config.policies import policies_from_config


def load(**blocks):
    return load_config({"train_micro_batch_size_per_gpu": 1, **blocks}, world_size=1)


def problems(**blocks) -> str:
    with pytest.raises(ConfigError) as caught:
        load(**blocks)
    return "\n".join(caught.value.problems)


def test_shardwise_and_deepspeed_spellings_of_the_compile_block():
    assert not load().compile.enabled and load().sparse_attention is None
    ours = load(compile={"enabled": True, "mode": "max-autotune", "backend": "aot_eager"}).compile
    assert (ours.enabled, ours.mode, ours.backend) == (True, "max-autotune", "aot_eager")
    deepspeeds = load(compile={"enabled": True, "backend": "inductor", "kwargs": {"dynamic": False},
                               "deepcompile": False}).compile
    assert deepspeeds.kwargs == {"dynamic": False}


def test_deepspeeds_sparse_attention_block_with_its_defaults():
    section = load(sparse_attention={"mode": "bigbird", "num_random_blocks": 2}).sparse_attention
    assert (section.block, section.num_sliding_window_blocks, section.num_global_blocks) == (16, 3, 1)
    assert load(sparse_attention={}).sparse_attention.mode == "fixed"


@pytest.mark.parametrize("blocks, message", [
    ({"compile": {"deepcompile": True, "passes": ["autotp"]}}, "set tensor_parallel.size instead"),
    ({"compile": {"kwargs": {"backend": "eager"}}}, "the backend is compile.backend"),
    ({"compile": {"mode": "default", "kwargs": {"mode": "max-autotune"}}}, "keep one"),
    ({"compile": {"enabeld": True}}, "did you mean 'compile.enabled'"),
    ({"sparse_attention": {"mode": "bigbird", "num_local_blocks": 2}}, "does not use ['num_local_blocks']"),
    ({"sparse_attention": {"mode": "fixed", "num_global_blocks": 3}}, "not divisible by num_global_blocks 3"),
    ({"sparse_attention": {"mode": "longformer"}}, "sparse_attention.mode"),
])
def test_bad_blocks_are_refused_naming_the_key(blocks, message):
    assert message in problems(**blocks)


def test_deepcompile_is_torch_compile_per_block_beside_the_run_time_zero(caplog):
    """DeepSpeed compiles ZeRO into the graph ("z1"/"z3" passes); shardwise compiles each
    block and runs the config's ZeRO stage, and says so."""
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        cfg = load(compile={"deepcompile": True, "passes": ["z3"]}, zero_optimization={"stage": 3})
    assert policies_from_config(cfg).compile.enabled
    assert "'compile.deepcompile' true and compile.passes ['z3']" in caplog.text


def test_the_kernel_and_compile_step_runs_when_any_of_its_blocks_asks_for_it():
    def enabled(config) -> bool:
        policies = policies_from_config(config)
        return policies.compile.enabled or policies.kernels.rewrites

    assert not enabled(load())
    assert enabled(load(compile={"enabled": True}))
    assert enabled(load(compile={"fused_ops": True}))
    assert enabled(load(sparse_attention={"mode": "dense"}))


def test_the_train_commands_compile_flag_enables_the_compile_block():
    from shardwise.tools.train.options import apply_flags, default_config

    config = apply_flags(default_config(10), None, False, 1, compile_blocks=True)
    assert load_config(config, world_size=2, hidden_size=384).compile.enabled
    assert not load_config(apply_flags(default_config(10), None, False, 1), world_size=2, hidden_size=384).compile.enabled


STAGE3 = {"zero_optimization": {"stage": 3}}


@pytest.mark.parametrize("compile_block, named", [
    ({"mode": "reduce-overhead"}, "compile.mode 'reduce-overhead'"),
    ({"mode": "max-autotune"}, "compile.mode 'max-autotune'"),
    ({"kwargs": {"mode": "reduce-overhead"}}, "compile.mode 'reduce-overhead'"),
    ({"kwargs": {"options": {"triton.cudagraphs": True}}}, "compile.kwargs.options['triton.cudagraphs'] True"),
    ({"backend": "cudagraphs"}, "compile.backend 'cudagraphs'"),
])
def test_cuda_graphs_with_stage_3_are_refused_with_the_reason_and_the_fix(compile_block, named):
    message = problems(compile={"enabled": True, **compile_block}, **STAGE3)
    assert f"{named} uses CUDA graphs, which zero_optimization.stage 3 cannot run" in message
    assert "stage 3 frees each module's parameters after use" in message
    assert "use compile.mode 'max-autotune-no-cudagraphs' or 'default'" in message
    assert "or zero_optimization.stage 2 or lower" in message


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_cuda_graphs_below_stage_3_are_accepted(mode, stage):
    assert load(compile={"enabled": True, "mode": mode}, zero_optimization={"stage": stage}).compile.mode == mode


@pytest.mark.parametrize("compile_block", [
    {"mode": "max-autotune-no-cudagraphs"}, {"mode": "default"}, {},
    {"kwargs": {"options": {"triton.cudagraphs": False, "triton.cudagraph_trees": True}}},
])
def test_stage_3_compiles_without_cuda_graphs(compile_block):
    assert load(compile={"enabled": True, **compile_block}, **STAGE3).compile.enabled
    assert load(compile={"enabled": False, "mode": "reduce-overhead"}, **STAGE3).compile.mode == "reduce-overhead"
