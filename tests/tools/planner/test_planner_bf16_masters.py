"""`shardwise estimate --bf16-masters`: bf16 master weights, gradients and optimizer states
price K as Adam's two 2-byte states (4 instead of 12) and offer only what the engine runs
with them: ZeRO stages 1-3 without offload."""

import pytest

from shardwise.tools.cli.main import main
from shardwise.tools.planner import Hardware, ModelShape, Offload, estimate


def test_k_is_four_and_only_on_device_stages_are_offered() -> None:
    result = estimate(ModelShape.from_params(7.5e9), Hardware(64), bf16_masters=True)
    assert result.optimizer_state_bytes == 4
    assert {(option.stage, option.offload) for option in result.options} == {(1, Offload()), (2, Offload()),
                                                                              (3, Offload())}
    # stage 1: 2Ψ + 2Ψ + 4Ψ/N, against 2Ψ + 2Ψ + 12Ψ/N with fp32 masters
    assert result.option(1).gpu_model_states == 4 * 7_500_000_000 + 4 * 7_500_000_000 // 64
    plain = estimate(ModelShape.from_params(7.5e9), Hardware(64))
    assert plain.option(1).gpu_model_states - result.option(1).gpu_model_states == 8 * 7_500_000_000 // 64


def test_the_command_line_shows_the_bf16_states(capsys) -> None:
    assert main(["estimate", "--params", "1e9", "--bf16-masters"]) == 0
    assert "K = 4 bytes/parameter (bf16 optimizer states 4" in " ".join(capsys.readouterr().out.split())


def test_bf16_masters_need_bf16_training(capsys) -> None:
    assert main(["estimate", "--params", "1e9", "--bf16-masters", "--dtype", "fp16"]) == 2
    assert "bf16 masters need bf16 training" in capsys.readouterr().err
