"""Optimizers by config name with their K (bytes of state per parameter, docs/formulas.md#optimizer-state-bytes-k), and the
codec through which their state is checkpointed."""

from dataclasses import dataclass

import pytest
import torch

import shardwise
from shardwise.frontends.deepspeed.config import ConfigError, load_config
from shardwise.frontends.deepspeed.config.params import OPTIMIZER_PARAMS
from shardwise.runtime.optim import ElementwiseCodec, optimizer_spec, registered_optimizers, registry
from shardwise.runtime.optim.params import param
from shardwise.runtime.optim.registry import OptimizerSpec, register_optimizer
from shardwise.tools.planner import Hardware, ModelShape, estimate
from shardwise.tools.planner.optimizers import optimizer_names
from shardwise.tools.train.options import DEFAULT_LR, optimizer_block


def test_every_config_optimizer_type_has_a_registry_entry():
    assert sorted(OPTIMIZER_PARAMS) == registered_optimizers()


@pytest.mark.parametrize(("name", "params", "dtype", "k"), [
    ("Adam", {}, "bf16", 12), ("AdamW", {}, "fp32", 8),
    ("SGD", {"momentum": 0.9}, "bf16", 8), ("SGD", {"momentum": 0.0}, "fp32", 0),
])
def test_state_bytes_per_parameter(name, params, dtype, k):
    assert optimizer_spec(name).state_bytes_per_param(params, dtype) == k


def test_deepspeed_adam_means_decoupled_weight_decay_unless_told_otherwise():
    weights = [torch.nn.Parameter(torch.zeros(3))]
    assert type(optimizer_spec("Adam").build([{"params": weights}], {"lr": 0.1})) is torch.optim.AdamW
    coupled = optimizer_spec("Adam").build([{"params": weights}], {"lr": 0.1, "adam_w_mode": False})
    assert type(coupled) is torch.optim.Adam


def test_unknown_optimizer_names_the_registered_ones():
    with pytest.raises(ValueError, match="no optimizer 'MuAdam'; registered: Adafactor, Adagrad, Adam, Adam8bit, "
                                         "AdamW, AdamW8bit, Lamb, Lars, Lion, Muon, OneBitAdam, OneBitLamb, SGD"):
        optimizer_spec("MuAdam")


def test_elementwise_codec_round_trip_and_state_bytes():
    weights = torch.nn.Parameter(torch.randn(5))
    optimizer = torch.optim.AdamW([weights], lr=0.1)
    weights.grad = torch.ones(5)
    optimizer.step()
    state = optimizer.state[weights]
    codec = ElementwiseCodec()
    elements, scalars = codec.encode(state, 5)
    assert sorted(elements) == ["exp_avg", "exp_avg_sq"] and sorted(scalars) == ["step"]
    assert codec.state_bytes(state, 5) == 2 * 5 * 4
    rebuilt = codec.decode({key: value.clone() for key, value in elements.items()}, scalars)
    assert rebuilt.keys() == state.keys()
    assert all(torch.equal(rebuilt[key], state[key]) for key in state)


# -- an optimizer is one file: registering it is all the rest of shardwise needs -------------
@dataclass(frozen=True)
class SignDescentParams:
    lr: float = param(1e-2, ge=0)
    momentum: float = param(0.0, ge=0, lt=1)

    def __post_init__(self) -> None:
        if self.lr == 0 and self.momentum:
            raise ValueError("momentum without a learning rate moves nothing")


class SignDescent(torch.optim.Optimizer):
    """w <- w - lr * sign(g), or of its momentum when momentum is on."""

    def __init__(self, params, lr: float = 1e-2, momentum: float = 0.0):
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for weight in group["params"]:
                if weight.grad is None:
                    continue
                direction = weight.grad
                if group["momentum"]:
                    buffer = self.state[weight].setdefault("momentum_buffer", torch.zeros_like(weight))
                    direction = buffer.mul_(group["momentum"]).add_(weight.grad)
                weight.sub_(group["lr"] * direction.sign())


@pytest.fixture
def sign_descent(monkeypatch):
    """SignDescent registered for this test only."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    return register_optimizer(OptimizerSpec(
        "SignDescent", SignDescentParams, lambda groups, params: SignDescent(groups, **params),
        fp32_states=lambda params: int(params.get("momentum", 0) > 0),
    ))


def test_a_registered_optimizer_is_known_to_the_config_planner_and_main_job(sign_descent):
    config = load_config({"train_batch_size": 2, "optimizer": {"type": "signdescent"}}, world_size=1)
    assert (config.optimizer.type, config.optimizer.params) == ("SignDescent", {"lr": 1e-2, "momentum": 0.0})
    with pytest.raises(ConfigError) as caught:
        load_config({"train_batch_size": 2, "optimizer": {"type": "SignDescent", "params": {
            "momentum": 1.0, "nesterov": True}}}, world_size=1)
    assert caught.value.problems == [
        "unknown key 'optimizer.params.nesterov'; the keys accepted in 'optimizer.params' are: lr, momentum, "
        "set_grad_none",
        "optimizer.params.momentum: Input should be less than 1 (got 1.0)",
    ]
    with pytest.raises(ConfigError, match="optimizer.params: momentum without a learning rate moves nothing"):
        load_config({"train_batch_size": 2, "optimizer": {"type": "SignDescent", "params": {
            "lr": 0, "momentum": 0.5}}}, world_size=1)

    assert "signdescent" in optimizer_names()
    result = estimate(ModelShape("1B", 1_000_000_000), Hardware(num_gpus=8), optimizer="signdescent")
    assert result.optimizer_state_bytes == 4 + 4  # its momentum (assumed on) and the fp32 master
    assert optimizer_block("signdescent", steps=10) == {"type": "SignDescent", "params": {"lr": DEFAULT_LR}}


def test_a_registered_optimizer_trains_from_the_config(sign_descent):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    inputs = torch.randn(3, 4)
    start = [weight.detach().clone().requires_grad_() for weight in model.parameters()]
    grads = torch.autograd.grad(torch.nn.functional.linear(inputs, *start).square().sum(), start)
    engine = shardwise.initialize(model, {"train_batch_size": 1, "optimizer": {"type": "SignDescent", "params": {
        "lr": 0.5}}})
    engine.backward(engine(inputs).square().sum())
    engine.step()
    assert type(engine.optimizer.optimizer) is SignDescent
    for weight, first, grad in zip(model.parameters(), start, grads, strict=True):
        torch.testing.assert_close(weight.detach(), first.detach() - 0.5 * grad.sign(), rtol=0, atol=0)
