"""The formulas' numbers (docs/formulas.md) the report prints beside the measured ones."""

import pytest

from shardwise.tools.train.expected import (
    RunShape,
    comm_expressions,
    expected_comm,
    expected_memory,
    memory_expressions,
    optimizer_state_bytes,
)
from shardwise.tools.train.report import difference, tied_weight_note

PAPER = dict(num_params=7_500_000_000, world_size=64, dtype="bf16", comm_dtype="bf16", optimizer_state_bytes=12)
RING = 63 / 64


@pytest.mark.parametrize("stage,total_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_memory_is_the_paper_table(stage, total_gb):
    memory = expected_memory(RunShape(stage=stage, **PAPER))
    assert sum(memory.values()) / 1e9 == pytest.approx(total_gb, abs=0.05)


def test_comm_per_stage_follows_section_4():
    psi = PAPER["num_params"]
    volume = {stage: expected_comm(RunShape(stage=stage, **PAPER)) for stage in range(4)}
    assert volume[0] == {"all_reduce": pytest.approx(2 * 2 * psi * RING), "all_gather": 0, "reduce_scatter": 0}
    for stage in (1, 2):
        assert volume[stage]["all_reduce"] == 0
        assert volume[stage]["all_gather"] == volume[stage]["reduce_scatter"] == pytest.approx(2 * psi * RING)
    assert sum(volume[3].values()) == pytest.approx(3 * 2 * psi * RING)


def test_stage3_persistent_parameters_are_gathered_once():
    shape = RunShape(stage=3, num_params=1000, world_size=2, dtype="fp32", comm_dtype="fp32",
                     optimizer_state_bytes=8, persistent_params=100)
    assert expected_comm(shape)["all_gather"] == 2 * 900 * 4 // 2 + 100 * 4 // 2
    assert expected_memory(shape)["params"] == 4 * 450 + 4 * 100
    assert memory_expressions(shape)["params"] == "4(Ψ−P)/N + 4P"
    assert comm_expressions(shape)["all_gather"] == "(2(Ψ−P) + P)·4(N−1)/N"


def test_gradients_travel_in_the_communication_dtype():
    shape = RunShape(stage=2, num_params=1000, world_size=4, dtype="bf16", comm_dtype="fp32", optimizer_state_bytes=12)
    assert expected_comm(shape) == {"all_reduce": 0, "all_gather": 1500, "reduce_scatter": 3000}


def test_optimizer_state_bytes_per_parameter():
    assert optimizer_state_bytes("AdamW", "bf16") == 12
    assert optimizer_state_bytes("Adam", "fp32") == 8
    assert optimizer_state_bytes("SGD", "fp32", momentum=0.9) == 4
    assert optimizer_state_bytes("SGD", "fp32") == 0
    assert optimizer_state_bytes("Lamb", "bf16") == 12
    with pytest.raises(ValueError, match="no state formula for optimizer 'MuAdam'"):
        optimizer_state_bytes("MuAdam", "fp32")


def test_report_labels_differences():
    assert "exact" in difference(10, 10, 0)
    assert difference(14, 10, 8) == "+4 B [green](padding)[/]"
    assert difference(30, 10, 8) == "+20 B"
    note = tied_weight_note(3, 2 * 16_384, 8_192, 2, "fp32")
    assert note is not None and "2 gather(s) of the tied embedding" in note
    assert tied_weight_note(3, 1000, 8_192, 2, "fp32") is None
    assert tied_weight_note(2, 16_384, 8_192, 2, "fp32") is None


def test_accumulation_repeats_what_stages_2_and_3_do_per_micro_batch():
    base = dict(num_params=1000, world_size=2, dtype="fp32", comm_dtype="fp32", optimizer_state_bytes=8,
                accumulation_steps=4)
    share = 1000 * 4 // 2
    assert expected_comm(RunShape(stage=0, **base))["all_reduce"] == 2 * share
    assert expected_comm(RunShape(stage=1, **base))["reduce_scatter"] == share
    stage2, stage3 = expected_comm(RunShape(stage=2, **base)), expected_comm(RunShape(stage=3, **base))
    assert stage2 == {"all_reduce": 0, "all_gather": share, "reduce_scatter": 4 * share}
    assert stage3 == {"all_reduce": 0, "all_gather": 8 * share, "reduce_scatter": 4 * share}
    assert comm_expressions(RunShape(stage=3, **base))["all_gather"] == "A·2·4Ψ(N−1)/N"
