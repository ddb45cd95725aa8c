"""LAMB under every ZeRO stage (C16): trust ratios of whole parameters, from partial norms
reduced over the shard group, so a partitioned run equals one process on full weights."""

from functools import lru_cache

import pytest
import torch

from shardwise.runtime.optim.lamb import Lamb
from shardwise.tools.testing import run_distributed
from tests.runtime.zero.workers import Case, assert_matches_reference, train_parallel, train_reference


@lru_cache(maxsize=None)
def reference(world_size: int, model: str) -> dict:
    return train_reference(Case(optimizer="lamb", model=model), world_size)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lamb_matches_single_process_at_every_stage(stage, world_size):
    model = "gpt-untied" if stage == 3 else "gpt"
    extra = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if stage == 3 else {}
    case = Case(stage=stage, optimizer="lamb", model=model, extra_config=extra)
    for result in run_distributed(train_parallel, world_size, case):
        assert_matches_reference(result, reference(world_size, model), 1e-5)


def test_lamb_follows_the_papers_update_on_one_tensor():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 4))
    grad = torch.randn(6, 4)
    lr, (beta1, beta2), eps, decay = 0.1, (0.9, 0.999), 1e-8, 0.01
    expected = weight.detach().clone()
    m, v = (1 - beta1) * grad, (1 - beta2) * grad * grad
    update = m / (v.sqrt() + eps) + decay * expected
    ratio = min(max(expected.norm() / update.norm(), 0.01), 10.0)
    step_size = lr * (1 - beta2) ** 0.5 / (1 - beta1)
    expected -= step_size * ratio * update
    optimizer = Lamb([weight], lr=lr, weight_decay=decay)
    weight.grad = grad
    optimizer.step()
    assert torch.allclose(weight.detach(), expected, rtol=1e-6, atol=1e-7)
    assert optimizer.last_trust_ratios[0].item() == pytest.approx(ratio.item())


def test_lamb_from_the_config_with_deepspeeds_keys():
    import shardwise
    from tests.runtime.zero.workers import build_model, global_batch

    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "weight_decay": 0.01, "bias_correction": False,
                                                        "max_coeff": 0.3, "min_coeff": 0.01}}}
    engine = shardwise.initialize(build_model("gpt"), config)
    assert isinstance(engine.optimizer.optimizer, Lamb)
    x, y = global_batch(0, 2)
    engine.backward(engine(x, y))
    engine.step()
    ratios = engine.optimizer.optimizer.last_trust_ratios
    assert ((ratios >= 0.01) & (ratios <= 0.3)).all()
    # K = 8 in fp32 (momentum and variance), per parameter element: padding has no state
    assert engine.memory_breakdown()["optimizer_states"] == 8 * engine.num_parameters()


def test_lamb_state_is_checkpointed_and_resharded(tmp_path):
    from tests.runtime.checkpoint.workers import Run, train_run
    from tests.runtime.zero.workers import relative_error

    rows, lr = 8, 1e-2
    saved = run_distributed(train_run, 2, Run(Case(stage=2, optimizer="lamb", lr=lr), rows=rows, steps=1,
                                             save_dir=str(tmp_path)))[0]
    resumed = run_distributed(train_run, 1, Run(Case(stage=0, optimizer="lamb", lr=lr), rows=rows, first_step=1,
                                               load_dir=str(tmp_path)))[0]
    expected = train_reference(Case(steps=3, micro_batch=rows, lr=lr, optimizer="lamb"), world_size=1)
    for step, got in enumerate(saved["losses"] + resumed["losses"]):
        assert abs(got - expected["losses"][step]) / expected["losses"][step] < 1e-5, step
    for name, want in expected["params"].items():
        assert relative_error(resumed["params"][name], want) < 1e-5, name
