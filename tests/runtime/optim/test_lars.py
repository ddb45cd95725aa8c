"""LARS under every ZeRO stage (C16): trust ratios of whole parameters from partial norms
reduced over the shard group, so a partitioned run equals one process on full weights."""

import pytest
import torch

from shardwise.runtime.optim.lars import Lars
from tests.runtime.optim.workers import (
    STAGES_AND_WORLDS,
    assert_resume_matches,
    check_against_one_process,
    save_then_resume,
    step_once_in_process,
)

CONFIG = {"type": "Lars", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "trust_coefficient": 0.02}}


@pytest.mark.parametrize(("stage", "world_size"), STAGES_AND_WORLDS)
def test_lars_matches_single_process_at_every_stage(stage, world_size):
    check_against_one_process("lars", stage, world_size, 1e-5)


def test_lars_follows_the_rule_on_one_matrix_and_excludes_vectors():
    torch.manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4))
    grads = [torch.randn(6, 4), torch.randn(4)]
    lr, momentum, decay, eta, eps = 0.5, 0.9, 0.01, 0.02, 1e-8
    expected_w, expected_b = weight.detach().clone(), bias.detach().clone()
    buffers = [None, None]
    optimizer = Lars([weight, bias], lr=lr, momentum=momentum, weight_decay=decay, trust_coefficient=eta, eps=eps)
    for step in range(2):
        for k, (value, grad) in enumerate(zip((expected_w, expected_b), grads)):
            trust = eta * value.norm() / (grad.norm() + decay * value.norm() + eps) if k == 0 else 1.0
            direction = trust * (grad + decay * value)
            buffers[k] = direction.clone() if step == 0 else momentum * buffers[k] + direction
            value -= lr * buffers[k]
        weight.grad, bias.grad = grads[0].clone(), grads[1].clone()
        optimizer.step()
    assert torch.allclose(weight.detach(), expected_w, rtol=1e-6, atol=1e-7)
    assert torch.allclose(bias.detach(), expected_b, rtol=1e-6, atol=1e-7)
    assert optimizer.last_trust_ratios[1].item() == 1.0


def test_lars_adapts_vectors_when_told_and_a_zero_norm_means_trust_one():
    vector, zeros = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.zeros(2, 2))
    optimizer = Lars([vector, zeros], lr=1.0, trust_coefficient=0.1, exclude_vectors=False)
    vector.grad, zeros.grad = torch.full((4,), 2.0), torch.ones(2, 2)
    optimizer.step()
    ratio = 0.1 * 2.0 / (4.0 + 1e-8)  # ||w|| = 2, ||g|| = 4
    assert optimizer.last_trust_ratios.tolist() == pytest.approx([ratio, 1.0])
    assert torch.allclose(vector.detach(), torch.full((4,), 1.0 - 2.0 * ratio))
    assert torch.equal(zeros.detach(), -torch.ones(2, 2))


def test_lars_from_a_deepspeed_config_keeps_one_momentum_buffer():
    engine = step_once_in_process(CONFIG)
    assert isinstance(engine.optimizer.optimizer, Lars)
    assert engine.memory_breakdown()["optimizer_states"] == 4 * engine.num_parameters()  # K = 4 in fp32


def test_lars_state_is_checkpointed_and_resharded(tmp_path):
    saved, resumed, expected = save_then_resume(tmp_path, CONFIG)
    assert_resume_matches(saved[0], resumed, expected, 1e-5)
