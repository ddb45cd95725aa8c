"""`shardwise estimate --pp P`: each pipeline stage holds 1/P of the layers, ZeRO shards over
GPUs / (T·P), and ZeRO-3 is not offered (the engine refuses it with pipeline parallelism)."""

from math import ceil

from shardwise.formulas.memory import placed_model_state_bytes
from shardwise.formulas.parallel_activation import ModelParallel
from shardwise.tools.planner.recommend import Hardware, estimate
from shardwise.formulas.model_shape import ModelShape
from shardwise.models.shapes import preset_shape
from tests.tools.planner.test_planner_cli import run_estimate


def test_a_stage_holds_its_share_and_zero_shards_over_the_data_ranks():
    shape = preset_shape("llama-7b")
    plain = estimate(shape, Hardware(8), seq_len=2048)
    piped = estimate(shape, Hardware(8), seq_len=2048, parallel=ModelParallel(pipeline=2))
    local = ceil(shape.num_params / 2)
    assert piped.params_per_rank == local and piped.zero_ranks == 4
    for stage in (0, 1, 2):
        assert piped.option(stage).per_rank == placed_model_state_bytes(local, 4, stage)
    assert all(option.stage < 3 for option in piped.options)
    # 1F1B's first stage holds P micro-batches through L/P layers: the bytes of one through all L
    assert piped.activations == plain.activations


def test_pipeline_with_tensor_parallelism_divides_both():
    shape = preset_shape("llama-7b")
    result = estimate(shape, Hardware(8), seq_len=2048, parallel=ModelParallel(tensor=2, megatron_sp=True, pipeline=2))
    assert result.zero_ranks == 2
    assert result.params_per_rank == ceil(shape.params_per_tensor_rank(2) / 2)


def test_cli_explains_the_stages_and_refuses_sizes_that_do_not_divide(capsys):
    code, out, _ = run_estimate(["--preset", "llama-7b", "--gpus", "8", "--pp", "2"], capsys)
    assert code == 0
    text = " ".join(out.split())
    assert "P = 2 pipeline stages, each holding ⌈Ψ_T / P⌉ = 3,369,207,808 parameters" in text
    assert "N = 4 data-parallel ranks" in text
    code, _, err = run_estimate(["--preset", "llama-7b", "--gpus", "6", "--pp", "4"], capsys)
    assert code == 2 and "--pp 4 × --tp 1 does not divide --gpus 6" in err
    code, _, err = run_estimate(["--preset", "gpt2", "--gpus", "64", "--pp", "64"], capsys)
    assert code == 2 and "more stages than the model's 12 layers" in err
