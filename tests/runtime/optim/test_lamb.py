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


def test_lamb_step_by_tensor_equals_both_passes_over_every_tensor():
    """Without ZeRO the native kernels step each parameter's two passes back to back, its
    trust ratio computed in between; with shard sums attached (here each piece a whole
    parameter, the sum the identity) every parameter's first pass runs, then every second.
    The same weights, moments and trust ratios, bit for bit: two param groups, weight
    decay in one, eps inside the root in the other, a parameter without a gradient, and a
    weight that starts at zero (its first ratio 1)."""
    from shardwise.runtime.optim import native
    from shardwise.runtime.optim.sharded import ParameterShard

    if not native.enabled():
        pytest.skip("the native kernels are off or cannot be built here")
    generator = torch.Generator().manual_seed(11)
    shapes = [(64, 48), (48,), (300,), (16, 16)]
    initial = [torch.randn(shape, generator=generator) for shape in shapes]
    initial[3].zero_()
    grads = [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(3)]

    def run(batched: bool) -> tuple[list[torch.Tensor], Lamb]:
        params = [torch.nn.Parameter(value.clone()) for value in initial]
        optimizer = Lamb([{"params": params[:2], "weight_decay": 0.01},
                          {"params": params[2:], "eps_inside_sqrt": True}], lr=1e-2)
        if batched:
            optimizer.attach_shards({p: ParameterShard(str(i), tuple(p.shape), 0, p.numel(), i)
                                     for i, p in enumerate(params)}, len(params), lambda tensor: tensor)
        for step_grads in grads:
            for index, (param, grad) in enumerate(zip(params, step_grads)):
                param.grad = None if index == 1 else grad.clone()
            optimizer.step()
        return params, optimizer

    (by_tensor, one), (batched, other) = run(False), run(True)
    for mine, theirs in zip(by_tensor, batched):
        assert torch.equal(mine, theirs)
        if mine in one.state:
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(one.state[mine][key], other.state[theirs][key]), key
    assert torch.equal(one.last_trust_ratios, other.last_trust_ratios)
    assert not torch.equal(by_tensor[0], initial[0]) and not torch.equal(by_tensor[3], initial[3])
