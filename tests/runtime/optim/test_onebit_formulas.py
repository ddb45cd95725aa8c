"""The 1-bit optimizers' formulas where the estimator and the main job's report use them:
memory per ZeRO stage (the momentum and the worker's error whole on every rank, the rest
partitioned), the step's bytes after the warm-up, and no stage 3 or offload offered."""

from __future__ import annotations

import pytest

from shardwise.tools.planner import Hardware, ModelShape, estimate
from shardwise.formulas.communication import onebit_exchange_bytes
from shardwise.formulas.memory import onebit_model_state_bytes, placed_model_state_bytes
from shardwise.runtime.optim.registry import optimizer_spec
from shardwise.tools.train.expected import RunShape, expected_comm, expected_memory, memory_expressions

PSI, N = 8_000_000, 4


@pytest.mark.parametrize("lamb", [False, True])
def test_memory_per_stage(lamb):
    """bf16, Adam: stage 0 (2 + 2 + 16)Ψ + 4Ψ/N; stages 1-2 8Ψ + 12Ψ/N of state (master,
    variance and server error partitioned), stage 2's gradients 2Ψ + 2Ψ/N; LAMB adds 4
    per element of the fresh variance, whole at stage 0 and partitioned at stages 1-2."""
    extra = 4 if lamb else 0
    stage0 = onebit_model_state_bytes(PSI, N, 0, "bf16", lamb)
    assert stage0 == {"params": 2 * PSI, "grads": 2 * PSI, "optimizer_states": (16 + extra) * PSI + 4 * PSI // N}
    for stage in (1, 2):
        memory = onebit_model_state_bytes(PSI, N, stage, "bf16", lamb)
        assert memory["optimizer_states"] == 8 * PSI + (12 + extra) * PSI // N
        assert memory["grads"] == 2 * PSI + (2 * PSI // N if stage == 2 else 0)
        own_terms = optimizer_spec("OneBitLamb" if lamb else "OneBitAdam").state_terms
        assert placed_model_state_bytes(PSI, N, stage, dtype="bf16", own_terms=own_terms)["gpu"] == memory
    with pytest.raises(ValueError, match="stages 0-2, not 3"):
        onebit_model_state_bytes(PSI, N, 3)


def test_exchange_bytes_per_stage():
    """After the warm-up: (L/8 + 4N)(N−1)/N each way; stages 1-2 add ZeRO's parameter
    all-gather pΨ(N−1)/N (L: Ψ/N rounded up to whole bytes, times N)."""
    framed = PSI // 8 + 4 * N
    assert onebit_exchange_bytes(PSI, N) == {"all_to_all": framed * 3 // 4, "all_gather": framed * 3 // 4}
    assert onebit_exchange_bytes(PSI, N, stage=2, param_bytes=2) == {
        "all_to_all": framed * 3 // 4, "all_gather": framed * 3 // 4 + 2 * PSI * 3 // 4}


def test_main_job_expects_the_onebit_formulas():
    shape = RunShape(PSI, N, 2, "bf16", "bf16", 16, optimizer_type="OneBitAdam")
    assert expected_memory(shape) == onebit_model_state_bytes(PSI, N, 2, "bf16")
    assert expected_comm(shape) == {"all_reduce": 0, "reduce_scatter": 0,
                                    **onebit_exchange_bytes(PSI, N, stage=2, param_bytes=2)}
    assert memory_expressions(shape) == {"params": "2Ψ", "grads": "2Ψ + 2Ψ/N", "optimizer_states": "8Ψ + 12Ψ/N"}


def test_estimator_offers_stages_0_to_2_without_offload():
    result = estimate(ModelShape("1.5B", 1_500_000_000), Hardware(num_gpus=8),
                      optimizer="onebitadam")
    assert [(option.stage, option.offload.label) for option in result.options] == [
        (0, "none"), (1, "none"), (2, "none")]
    for option in result.options:
        assert option.per_rank["gpu"] == onebit_model_state_bytes(1_500_000_000, 8, option.stage, "bf16")
