"""bf16 master weights, gradients and optimizer states (DeepSpeed's
`bf16.bf16_master_weights_and_grads` with `bf16_optimizer_states`): ZeRO trains the bf16
partition in place with bf16 Adam states, so a run equals plain PyTorch training a bf16
model with torch's AdamW (bf16 states), and holds K = 4 bytes per parameter instead of 12:
memory_breakdown() equals the formula to the byte."""

import pytest
import torch

from shardwise.formulas.memory import ADAM_FP32_STATES, model_state_bytes, optimizer_state_bytes
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.workers import (Case, assert_matches_reference, build_model, global_batch, make_optimizer,
                                        model_loss, train_parallel)

BF16_MASTERS = {"bf16": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}


def case_for(stage: int, **options) -> Case:
    return Case(stage=stage, dtype="bf16", model="gpt-untied" if stage == 3 else "gpt",
                extra_config={**BF16_MASTERS, "zero_optimization": {"stage3_param_persistence_threshold": 0}},
                **options)


def bf16_reference(case: Case, world_size: int) -> dict:
    """One process, the model in bf16, torch's AdamW over its bf16 parameters (so bf16
    states), the same global batches and clipping."""
    model = build_model(case.model).to(torch.bfloat16)
    optimizer = make_optimizer(model, case.lr, case.optimizer)
    rows = world_size * case.accumulation * case.micro_batch
    losses = []
    for step in range(case.steps):
        x, y = global_batch(step, rows)
        loss = model_loss(model, case.model, x, y)
        loss.float().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), case.clipping)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {name: p.detach().float() for name, p in model.named_parameters()}}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_trains_like_a_bf16_model_with_bf16_adam(stage):
    case = case_for(stage)
    result = run_distributed(train_parallel, 2, case)[0]
    assert_matches_reference(result, bf16_reference(case, 2), tolerance=2e-2)


@pytest.mark.parametrize("stage", [1, 2])
def test_memory_is_the_formula_with_bf16_states_and_no_master(stage):
    world = 2
    result = run_distributed(train_parallel, world, case_for(stage, steps=1))[0]
    padded = result["numel"] + result["padding"]
    k = optimizer_state_bytes(ADAM_FP32_STATES, "bf16", bf16_masters=True)
    assert k == 4
    expected = model_state_bytes(padded, world, stage, "bf16", k)
    assert {category: result["memory"][category] for category in expected} == expected
    fp32_masters = model_state_bytes(padded, world, stage, "bf16")
    assert fp32_masters["optimizer_states"] == 3 * expected["optimizer_states"]
