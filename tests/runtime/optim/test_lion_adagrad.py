"""DeepSpeed's config optimizers "Lion" and "Adagrad": each rule against its arithmetic
written out (and, with DEEPSPEED_PYTHON set, against DeepSpeed 0.19.8's own CPU ops), 2
ranks at ZeRO 1 and 3 equal to one process, and K (their state bytes) equal to what the
engine holds.

Lion steps by the sign of an interpolation, which is discontinuous: its parallel runs
train a model whose gradients do not depend on the weights and are exact in fp32
(dyadic inputs, a loss linear in the output), so the all-reduce adds no rounding and the
trajectories agree to the bit. Its rule is checked one step at a time from given states.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from torch import nn

import shardwise
from shardwise.formulas.memory import model_state_bytes
from shardwise.frontends.deepspeed.api.ops.adagrad import DeepSpeedCPUAdagrad
from shardwise.frontends.deepspeed.api.ops.lion import DeepSpeedCPULion, FusedLion
from shardwise.runtime.optim.lion import Lion
from shardwise.runtime.optim.registry import optimizer_spec
from shardwise.tools.testing import run_distributed
from tests.runtime.checkpoint.workers import full_weights, train
from tests.runtime.zero.workers import build_model
from tests.runtime.optim.workers import ConfigRun, train_reference_from_config

LION = {"type": "Lion", "params": {"lr": 0.01, "betas": [0.9, 0.99], "weight_decay": 0.1}}
ADAGRAD = {"type": "Adagrad", "params": {"lr": 0.05, "weight_decay": 0.01, "initial_accumulator_value": 0.1}}
ROWS, STEPS = 8, 3


def _lion_in_float64(weight, momentum, grad, lr, betas, decay, step_up_at_zero):
    interpolation = betas[0] * momentum + (1 - betas[0]) * grad
    if step_up_at_zero:
        sign = torch.where(interpolation > 0, 1.0, -1.0).double()
    else:
        sign = torch.copysign(torch.ones_like(interpolation), interpolation)
    return weight * (1 - lr * decay) - lr * sign, betas[1] * momentum + (1 - betas[1]) * grad


@pytest.mark.parametrize("step_up_at_zero", [False, True])
def test_lion_follows_the_rule_step_by_step(step_up_at_zero):
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(70_000))  # more than one chunk of the update
    optimizer = Lion([weight], lr=0.01, betas=(0.9, 0.99), weight_decay=0.1, step_up_at_zero=step_up_at_zero)
    for step in range(3):
        grad = torch.randn(70_000)
        grad[:4] = torch.tensor([0.0, -0.0, 0.0, -0.0]) if step == 0 else grad[:4]  # c = +0 at the first step
        before = weight.detach().double().clone()
        momentum = optimizer.state[weight]["exp_avg"].double().clone() if step else torch.zeros(70_000, dtype=torch.float64)
        weight.grad = grad.clone()
        optimizer.step()
        want_weight, want_momentum = _lion_in_float64(before, momentum, grad.double(), 0.01, (0.9, 0.99), 0.1,
                                                      step_up_at_zero)
        assert torch.allclose(weight.detach().double(), want_weight, rtol=1e-6, atol=1e-7)
        assert torch.allclose(optimizer.state[weight]["exp_avg"].double(), want_momentum, rtol=1e-6, atol=1e-8)
    fresh = nn.Parameter(torch.zeros(2))
    fresh.grad = torch.tensor([0.0, -0.0])
    Lion([fresh], lr=0.5, step_up_at_zero=step_up_at_zero).step()
    # c = 0.9 * 0 + 0.1 * (±0) = +0: DeepSpeed's CPU op steps down, its CUDA kernel up
    assert fresh.detach().tolist() == ([0.5, 0.5] if step_up_at_zero else [-0.5, -0.5])


def test_lion_steps_a_non_contiguous_weight_as_a_contiguous_one():
    torch.manual_seed(1)
    values, grad = torch.randn(5, 7), torch.randn(5, 7)
    transposed, plain = nn.Parameter(values.t().contiguous().t()), nn.Parameter(values.clone())
    assert not transposed.is_contiguous()
    for weight in (transposed, plain):
        weight.grad = grad.clone()
        Lion([weight], lr=0.1, weight_decay=0.5).step()
    assert torch.equal(transposed.detach(), plain.detach())


def test_deepspeed_class_shapes():
    weight = nn.Parameter(torch.zeros(3))
    assert not DeepSpeedCPULion([weight], lr=0.1, fp32_optimizer_states=False).defaults["step_up_at_zero"]
    fused = FusedLion([weight], lr=0.1, set_grad_none=False)
    assert fused.defaults["step_up_at_zero"]
    weight.grad = torch.ones(3)
    fused.zero_grad()
    assert weight.grad is not None and not weight.grad.any()
    adagrad = DeepSpeedCPUAdagrad([weight], lr=0.1, weight_decay=0.5, amsgrad=True)
    assert isinstance(adagrad, torch.optim.Adagrad)
    assert (adagrad.defaults["lr"], adagrad.defaults["eps"], adagrad.defaults["lr_decay"]) == (0.1, 1e-10, 0)


DEEPSPEED_SIDE = """
import json, sys, torch
from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
from deepspeed.ops.lion import DeepSpeedCPULion
case = json.loads(sys.argv[1])
out = {"lion": [], "adagrad": []}
for name, build in (("lion", lambda p: DeepSpeedCPULion([p], lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)),
                    ("adagrad", lambda p: DeepSpeedCPUAdagrad([p], lr=0.05, weight_decay=0.01))):
    weight = torch.nn.Parameter(torch.tensor(case["weight"]))
    optimizer = build(weight)
    for grad in case["grads"]:
        weight.grad = torch.tensor(grad)
        optimizer.step()
        state = optimizer.state[weight]
        out[name].append([weight.detach().tolist(), (state["exp_avg"] if name == "lion" else state["exp_avg_sq"]).tolist()])
print(json.dumps(out))
"""


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to compare with its CPU Lion and Adagrad ops")
def test_cpu_ops_equal_deepspeeds():
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(40, generator=generator)
    grads = [torch.randn(40, generator=generator) for _ in range(3)]
    grads[0][:2] = torch.tensor([0.0, -0.0])  # c = +0 at the first step
    case = {"weight": weight.tolist(), "grads": [grad.tolist() for grad in grads]}
    ran = subprocess.run([os.environ["DEEPSPEED_PYTHON"], "-c", DEEPSPEED_SIDE, json.dumps(case)], check=True,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    theirs = json.loads(ran.stdout.strip().splitlines()[-1])
    lion_weight = nn.Parameter(weight.clone())
    lion = DeepSpeedCPULion([lion_weight], lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
    adagrad_weight = nn.Parameter(weight.clone())
    adagrad = DeepSpeedCPUAdagrad([adagrad_weight], lr=0.05, weight_decay=0.01)
    for step, grad in enumerate(grads):
        if step:  # Lion one step at a time from DeepSpeed's state: its sign is discontinuous
            lion_weight.data.copy_(torch.tensor(theirs["lion"][step - 1][0]))
            lion.state[lion_weight]["exp_avg"].copy_(torch.tensor(theirs["lion"][step - 1][1]))
        lion_weight.grad, adagrad_weight.grad = grad.clone(), grad.clone()
        lion.step()
        adagrad.step()
        for name, ours, state in (("lion", lion_weight, lion.state[lion_weight]["exp_avg"]),
                                  ("adagrad", adagrad_weight, adagrad.state[adagrad_weight]["sum"])):
            want_weight, want_state = (torch.tensor(values) for values in theirs[name][step])
            assert torch.allclose(ours.detach(), want_weight, rtol=1e-5, atol=1e-7), f"{name} step {step}"
            assert torch.allclose(state, want_state, rtol=1e-5, atol=1e-8), f"{name} state at step {step}"


class ExactGradients(nn.Module):
    """Two linear maps of the same input, summed, and a loss linear in the output: the
    gradients are the inputs' products with the targets, whatever the weights."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)  # pieces need no padding at 2 ranks

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.first(x) + self.second(x)) * y).sum() / len(x)  # rows a power of 2: exact


def _exact_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(20 + step)
    return (torch.randint(-4, 5, (rows, 8), generator=generator) / 4,
            torch.randint(-4, 5, (rows, 8), generator=generator) / 4)


def _train_lion(rank: int, world_size: int, stage: int) -> dict:
    config = {"train_micro_batch_size_per_gpu": ROWS // world_size, "optimizer": LION,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine = shardwise.initialize(ExactGradients(), config)
    share = ROWS // world_size
    for step in range(STEPS):
        x, y = _exact_batch(step, ROWS)
        engine.backward(engine(x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]))
        engine.step()
    with shardwise.gathered_parameters(list(engine.module.parameters())):
        weights = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    return {"weights": weights, "optimizer_states": engine.memory_breakdown()["optimizer_states"],
            "numel": sum(w.numel() for w in weights.values())}


@pytest.mark.parametrize("stage", [1, 3])
def test_lion_at_two_ranks_equals_one_process(stage):
    model = ExactGradients()
    optimizer = optimizer_spec("Lion").build([{"params": list(model.parameters())}], LION["params"])
    for step in range(STEPS):
        model(*_exact_batch(step, ROWS)).backward()
        optimizer.step()
        optimizer.zero_grad()
    for result in run_distributed(_train_lion, 2, stage):
        for name, want in model.named_parameters():
            error = ((result["weights"][name] - want.detach()).norm() / want.detach().norm()).item()
            assert error < 1e-5, f"stage {stage} {name}: relative error {error:.1e}"
        k = optimizer_spec("Lion").state_bytes_per_param(LION["params"], "fp32")
        want_bytes = model_state_bytes(result["numel"], 2, stage, "fp32", optimizer_state_bytes_per_param=int(k))
        assert result["optimizer_states"] == want_bytes["optimizer_states"]


def _train_adagrad(rank: int, world_size: int, run: ConfigRun) -> dict:
    engine = shardwise.initialize(build_model(run.model), run.config(world_size))
    losses = train(engine, run.model, rank, world_size, run.rows, range(run.steps))
    return {"losses": losses, "params": full_weights(engine), "class": type(engine.optimizer.optimizer).__name__,
            "optimizer_states": engine.memory_breakdown()["optimizer_states"]}


@pytest.mark.parametrize("stage", [1, 3])
def test_adagrad_at_two_ranks_equals_one_process(stage):
    expected = train_reference_from_config(ADAGRAD, rows=ROWS, steps=STEPS, model_kind="gpt-untied")
    for result in run_distributed(_train_adagrad, 2, ConfigRun(ADAGRAD, stage=stage, steps=STEPS,
                                                                  model="gpt-untied")):
        assert result["class"] == "Adagrad"
        for step, (got, want) in enumerate(zip(result["losses"], expected["losses"])):
            assert abs(got - want) / want < 1e-5, f"step {step}: loss {got} vs {want}"
        for name, want in expected["params"].items():
            error = ((result["params"][name] - want).norm() / want.norm()).item()
            assert error < 1e-5, f"stage {stage} {name}: relative error {error:.1e}"
        numel = sum(want.numel() for want in expected["params"].values())
        k = optimizer_spec("Adagrad").state_bytes_per_param(ADAGRAD["params"], "fp32")
        want_bytes = model_state_bytes(numel, 2, stage, "fp32", optimizer_state_bytes_per_param=int(k))
        assert result["optimizer_states"] == want_bytes["optimizer_states"]


def test_k_of_lion_and_adagrad():
    for name in ("Lion", "Adagrad"):
        assert optimizer_spec(name).state_bytes_per_param({}, "fp32") == 4
        assert optimizer_spec(name).state_bytes_per_param({}, "bf16") == 8  # with the fp32 master copy
