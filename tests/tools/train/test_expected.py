"""The formulas' numbers (docs/formulas.md) the report prints beside the measured ones."""

import pytest
from rich.console import Console

from shardwise.tools.train.expected import (
    ExpertShape,
    RunShape,
    comm_expressions,
    expected_comm,
    expected_memory,
    memory_expressions,
    optimizer_state_bytes,
)
from shardwise.tools.train.report import comm_table, difference, memory_table, tied_weight_note

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


@pytest.mark.parametrize("stage,total_gb,grads", [(1, 46.4, "4Ψ"), (2, 16.9, "4Ψ/N"), (3, 2.1, "4Ψ/N")])
def test_fp32_accumulation_counts_4_byte_gradients(stage, total_gb, grads):
    """data_types.grad_accum_dtype fp32 beside bf16 (docs/formulas.md#fp32-gradient-accumulation)."""
    shape = RunShape(stage=stage, grad_dtype="fp32", **PAPER)
    assert sum(expected_memory(shape).values()) / 1e9 == pytest.approx(total_gb, abs=0.05)
    assert memory_expressions(shape)["grads"] == grads
    assert expected_comm(shape) == expected_comm(RunShape(stage=stage, **PAPER))  # what is sent is unchanged


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


TINY_MOE = ExpertShape(params=66_816, ep_size=2, experts=4, layers=2, capacity=128, width=32)


def test_experts_trained_apart_add_their_own_terms_to_the_dense_ones():
    """The tiny GPT with 4 experts over ep_size 2 at stage 1 on 2 ranks (Ψ = 88,128, of which
    Ψ_E = 66,816): the dense 21,312 follow ZeRO, each rank keeps its 33,408 expert elements
    whole with their whole gradients and state, and the tokens cross in all-to-alls."""
    shape = RunShape(num_params=88_128, world_size=2, stage=1, dtype="fp32", comm_dtype="fp32",
                     optimizer_state_bytes=8, experts=TINY_MOE)
    assert expected_memory(shape) == {"params": 4 * 21_312 + 4 * 33_408, "grads": 4 * 21_312 + 4 * 33_408,
                                      "optimizer_states": 8 * 21_312 // 2 + 8 * 33_408}
    # 2 layers x 4 all-to-alls x half of the (4, 128, 32) fp32 buffer
    assert expected_comm(shape) == {"all_reduce": 0, "all_gather": 42_624, "reduce_scatter": 42_624,
                                    "all_to_all": 2 * 4 * 4 * 128 * 32 * 4 // 2}
    assert memory_expressions(shape) == {"params": "4Ψ_D + 4Ψ_E/P_E", "grads": "4Ψ_D + 4Ψ_E/P_E",
                                         "optimizer_states": "8Ψ_D/N + 8Ψ_E/P_E"}
    assert comm_expressions(shape)["all_to_all"] == "4·L_E·E·C·d·4(P_E−1)/P_E"
    assert comm_expressions(shape)["reduce_scatter"] == "4Ψ_D(N−1)/N"  # N_E = 1: no expert partner


def test_experts_with_partners_are_partitioned_over_the_expert_data_group():
    """4 ranks, ep_size 2 (N_E = 2), stage 3 with 500 persistent dense parameters, two
    micro-batches per step: the experts stay whole, their state and gradient slice halve."""
    shape = RunShape(num_params=88_128, world_size=4, stage=3, dtype="fp32", comm_dtype="fp32",
                     optimizer_state_bytes=8, persistent_params=500, accumulation_steps=2, experts=TINY_MOE)
    memory = expected_memory(shape)
    assert memory["params"] == 4 * (21_312 - 500) // 4 + 4 * 500 + 4 * 33_408
    assert memory["grads"] == 4 * 21_312 // 4 + 4 * 33_408
    assert memory["optimizer_states"] == 8 * 21_312 // 4 + 8 * 16_704
    comm = expected_comm(shape)
    assert comm["reduce_scatter"] == 2 * 4 * 21_312 * 3 // 4 + 4 * 33_408 // 2
    assert comm["all_gather"] == 2 * 2 * 4 * 20_812 * 3 // 4 + 4 * 500 * 3 // 4 + 4 * 33_408 // 2
    assert comm["all_to_all"] == 2 * (2 * 4 * 4 * 128 * 32 * 4 // 2)
    assert memory_expressions(shape)["optimizer_states"] == "8Ψ_D/N + 8⌈Ψ_E/(P_E·N_E)⌉"
    assert comm_expressions(shape)["all_to_all"] == "A·4·L_E·E·C·d·4(P_E−1)/P_E"


def test_dense_shapes_have_no_expert_terms_and_one_bit_refuses_experts():
    dense = RunShape(num_params=1000, world_size=2, stage=1, dtype="fp32", comm_dtype="fp32", optimizer_state_bytes=8)
    assert "all_to_all" not in expected_comm(dense) and dense.dense_params == 1000
    with pytest.raises(ValueError, match="no formula for OneBitAdam with expert parallelism"):
        RunShape(num_params=88_128, world_size=2, stage=1, dtype="fp32", comm_dtype="fp32", optimizer_state_bytes=16,
                 optimizer_type="OneBitAdam", experts=TINY_MOE)


def test_report_shows_the_expert_quantities_and_an_all_to_all_row():
    shape = RunShape(num_params=88_128, world_size=2, stage=1, dtype="fp32", comm_dtype="fp32",
                     optimizer_state_bytes=8, experts=TINY_MOE)
    memory, comm = expected_memory(shape), expected_comm(shape)
    summary = {
        "run": {"stage": 1, "world_size": 2, "dtype": "fp32", "comm_dtype": "fp32", "optimizer_state_bytes": 8},
        "model": {"num_params": 88_128}, "padding_elements": 0, "persistent_params": 0,
        "experts": {"params": 66_816, "ep_size": 2, "experts": 4, "layers": 2, "capacity": 128, "width": 32},
        "memory": {"measured": {**memory, "buffers": 0}, "formula": memory, "expressions": memory_expressions(shape)},
        "comm_per_step": {"measured": {**comm, "control": 88}, "formula": comm, "expressions": comm_expressions(shape)},
    }
    console = Console(record=True, width=250)
    console.print(memory_table(summary))
    console.print(comm_table(summary))
    text = console.export_text()
    titles = " ".join(text.split())  # the titles wrap at the tables' width
    assert "Ψ_E = 66,816 of Ψ (Ψ_D = 21,312), P_E = 2, N_E = 1" in titles
    assert "L_E = 2 MoE layers, E = 4, C = 128, d = 32" in titles
    rows = [line for line in text.splitlines() if line.startswith("│ all_to_all")]
    assert len(rows) == 1 and "0.262 MB" in rows[0] and "exact" in rows[0]
    del summary["experts"]
    console = Console(record=True, width=250)
    console.print(comm_table(summary))
    assert "all_to_all" not in console.export_text()  # a dense run's table is as before


def test_recomputed_moe_layers_send_their_forward_all_to_alls_again():
    experts = ExpertShape(params=66_816, ep_size=2, experts=4, layers=2, capacity=128, width=32, recomputed_layers=1)
    shape = RunShape(num_params=88_128, world_size=2, stage=2, dtype="fp32", comm_dtype="fp32",
                     optimizer_state_bytes=8, experts=experts)
    exchange = 4 * 128 * 32 * 4 // 2  # one all-to-all of the (4, 128, 32) fp32 buffer over 2 ranks
    assert expected_comm(shape)["all_to_all"] == (4 * 2 + 2 * 1) * exchange
    assert comm_expressions(shape)["all_to_all"] == "(4·L_E + 2·L_R)·E·C·d·4(P_E−1)/P_E"
