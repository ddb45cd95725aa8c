"""`shardwise estimate --grad-accum-dtype fp32`: micro-batch gradients summed in fp32 beside
16-bit training (DeepSpeed's `data_types.grad_accum_dtype`) price 4-byte gradient buffers
(docs/formulas.md#fp32-gradient-accumulation) and offer only the stages the engine runs it
at: 1-3, offload included."""

from shardwise.tools.cli.main import main
from shardwise.tools.planner import Hardware, ModelShape, Offload, estimate

PSI, N = 7_500_000_000, 64


def test_gradients_take_four_bytes_at_stages_1_to_3() -> None:
    result = estimate(ModelShape.from_params(7.5e9), Hardware(N), grad_accum_dtype="fp32")
    plain = estimate(ModelShape.from_params(7.5e9), Hardware(N))
    assert {option.stage for option in result.options} == {1, 2, 3}
    # stage 1: 2Ψ + 4Ψ + 12Ψ/N, the full buffer doubled; stages 2-3: the partition doubled
    assert result.option(1).gpu_model_states == 2 * PSI + 4 * PSI + 12 * PSI // N
    assert result.option(1).gpu_model_states - plain.option(1).gpu_model_states == 2 * PSI
    for stage in (2, 3):
        assert result.option(stage).gpu_model_states - plain.option(stage).gpu_model_states == 2 * PSI // N
    # offloaded: stage 1's accumulation buffer on the GPU is fp32; the host partition was fp32 already
    offloaded, plain_offloaded = result.option(1, Offload("cpu")), plain.option(1, Offload("cpu"))
    assert offloaded.gpu_model_states - plain_offloaded.gpu_model_states == 2 * PSI
    assert offloaded.cpu_per_node == plain_offloaded.cpu_per_node


def test_the_command_line_names_the_fp32_sum_and_refuses_it_beside_bf16_masters(capsys) -> None:
    assert main(["estimate", "--params", "1e9", "--grad-accum-dtype", "fp32"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "grads summed in fp32 (4 bytes each)" in out and "grads 4Ψ" in out
    assert main(["estimate", "--params", "1e9", "--grad-accum-dtype", "fp32", "--bf16-masters"]) == 2
    assert "bf16 masters take bf16 gradients" in capsys.readouterr().err
