"""The main job's report for an MoE GPT whose experts are split over expert groups: the
engine's own count of model-state bytes and of bytes sent equals the formulas
(shardwise/tools/train/expected.py over shardwise/formulas/) to the byte, every category
and every collective, the all-to-alls included."""

from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise.models import GPT, GPTConfig
from shardwise.tools.testing import run_distributed
from shardwise.tools.train.compare import stage_config
from shardwise.tools.train.expected import COLLECTIVES, MODEL_STATES, expected_comm, expected_memory
from shardwise.tools.train.options import apply_flags, default_config
from shardwise.tools.train.setup import run_shape

SEQ = 16


def measured_and_expected(rank: int, world_size: int, stages: list[int], *, experts: int, width: int, heads: int,
                          bf16: bool = False, persistent: bool = True, recompute: str | None = None) -> dict[int, dict]:
    """Two steps of a one-block MoE GPT (ep_size 2, untied embedding: stage 3 then gathers
    each parameter once per use, as the formula counts) at each stage: the ledger's
    model states and the second step's bytes beside the formulas. `persistent` False:
    stage 3 keeps no parameter whole (--compare-stages' setting), so every unit is padded;
    `recompute`: the activation-checkpointing policy at stage 3."""
    results = {}
    for stage in stages:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, block_size=SEQ, n_layer=1, n_head=heads, n_embd=width,
                              moe_experts=experts, moe_ep_size=2, tie_embeddings=False))
        num_params = sum(param.numel() for param in model.parameters())
        config = apply_flags(default_config(2), stage, bf16, 1, recompute=recompute if stage == 3 else None)
        engine = shardwise.initialize(model, config if persistent else stage_config(config, stage))
        for step in range(2):
            engine.reset_comm_volume()
            rows = engine.config.train_micro_batch_size_per_gpu
            tokens = torch.randint(0, 64, (rows, SEQ + 1), generator=torch.Generator().manual_seed(step + rank))
            engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
            engine.step()
        # Ψ as the engine pads ZeRO's flat buffers (docs/formulas.md#notation); the report
        # labels that difference "(padding)", the experts' own padding is in their terms
        shape = run_shape(engine, num_params + engine.padding_elements())
        results[stage] = {"memory": engine.memory_breakdown(), "comm": engine.comm_volume(),
                          "formula_memory": expected_memory(shape), "formula_comm": expected_comm(shape),
                          "expert_params": shape.experts.params, "expert_data_size": shape.expert_data_size,
                          "recomputed_layers": shape.experts.recomputed_layers}
        engine.destroy()
    return results


def assert_exact(results: dict[int, dict]) -> None:
    for stage, result in results.items():
        for category in MODEL_STATES:
            assert result["memory"][category] == result["formula_memory"][category], (stage, category, result)
        for op in (*COLLECTIVES, "all_to_all"):
            assert result["comm"][op] == result["formula_comm"][op], (stage, op, result)
        assert result["comm"]["all_to_all"] > 0


def test_moe_report_is_exact_at_stages_1_and_3():
    """2 ranks, ep_size 2: each rank keeps 2 of the 4 experts whole (N_E = 1: no expert
    gradient crosses ranks, the tokens do); the experts' whole gradients, their optimizer
    state and the all-to-alls (stage 3 with full recomputation: the MoE layer's forward
    ones twice) are what the formulas say."""
    for results in run_distributed(measured_and_expected, 2, [1, 3], experts=4, width=16, heads=2, recompute="full"):
        assert_exact(results)
        assert results[3]["recomputed_layers"] == 1 and results[1]["recomputed_layers"] == 0
        assert results[1]["expert_data_size"] == 1
        assert results[1]["expert_params"] == 4 * (8 * 16 * 16 + 5 * 16)  # 4 MLPs of width 16


@pytest.mark.slow
def test_moe_report_is_exact_with_partitioned_padded_experts_in_bf16():
    """4 ranks, ep_size 2 (N_E = 2): the one local expert of width 9 (693 elements, odd) is
    padded to 694 and its optimizer state, gradient and update split over the expert-data
    group, at stages 0-3 in bf16 (fp32 gradient reduction, 16-bit all-gather)."""
    for results in run_distributed(measured_and_expected, 4, [0, 1, 2, 3], experts=2, width=9, heads=3, bf16=True,
                                   persistent=False, timeout=240):
        assert_exact(results)
        assert results[1]["expert_data_size"] == 2
        assert results[1]["comm"]["reduce_scatter"] > results[0]["comm"]["reduce_scatter"]
