"""`module._external_params` as DeepSpeed 0.19.8 keeps it at stage 3 (DeepSpeed's
test_zero_context_return.py): a parameter a module returns is registered on the module that
goes on to use it; `register_external_parameter` / `unregister_external_parameter`."""

import copy

import pytest
import torch
from torch import nn

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.frontends.deepspeed.api.runtime.zero.partition_parameters import ZeroParamStatus


class ReturnsItsBias(nn.Linear):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, nn.Parameter]:
        return super().forward(x), self.bias


class PassesTheBiasOn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = ReturnsItsBias(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, nn.Parameter]:
        out, bias = self.inner(x)
        return out, bias


class UsesTheBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.passer = PassesTheBiasOn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, bias = self.passer(self.first(x))
        return (out + bias).square().sum()


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = UsesTheBias()
        self.seen: list[tuple[int, int, int, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.user(x)
        if hasattr(self, "_external_params"):  # as the registries stand once `user` returned
            self.seen.append((len(self._external_params), len(self.user._external_params),
                              len(self.user.passer._external_params), len(self.user.passer.inner._external_params)))
        return loss


def test_a_returned_parameter_is_registered_on_the_module_that_uses_it():
    torch.manual_seed(0)
    model = Model()
    reference = copy.deepcopy(model)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "gradient_clipping": 0.0,  # no clipping, as the reference; DeepSpeed 0.19.8 clips at 1.0 without the key
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    bias = model.user.passer.inner.bias
    assert bias.ds_status == ZeroParamStatus.NOT_AVAILABLE
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    inputs = [torch.randn(1, 4) for _ in range(3)]
    for x in inputs:
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        want = reference(x)
        want.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)  # the returned bias trains as usual
    # registered on `user` (it rose from `passer`, which returned it too), every forward alike
    assert model.seen == [(0, 1, 0, 0)] * len(inputs)
    assert list(model.user._external_params.values()) == [bias]
    engine.destroy()


def test_register_and_unregister_check_their_arguments():
    module, parameter = nn.Linear(2, 2), nn.Parameter(torch.zeros(2))
    deepspeed.zero.register_external_parameter(module, parameter)
    assert dict(module.ds_external_parameters()) == {id(parameter): parameter}
    deepspeed.zero.unregister_external_parameter(module, parameter)
    assert module._external_params == {}
    with pytest.raises(RuntimeError, match="not a registered external parameter of Linear"):
        deepspeed.zero.unregister_external_parameter(module, parameter)
    with pytest.raises(RuntimeError, match="takes a torch.nn.Parameter, got Tensor"):
        deepspeed.zero.register_external_parameter(module, torch.zeros(2))
