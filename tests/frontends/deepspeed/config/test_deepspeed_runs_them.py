"""Configs DeepSpeed 0.19.8 initializes that shardwise refused before (this morning's audit):
each now loads, honoured or accepted as harmless as DeepSpeed reads it; the few shardwise
still refuses cannot train (docs/deepspeed.md, "Where shardwise is stricter than
DeepSpeed"), and the neighbours both refuse stay refused. With DEEPSPEED_PYTHON set,
DeepSpeed itself initializes every config of the first two kinds and refuses the third."""

import json
import logging
import os

import pytest
import torch
from torch import nn

from shardwise.frontends.deepspeed.config import ConfigError, load_config
from shardwise.frontends.deepspeed.config.policies import policies_from_config
from shardwise.tools.testing import run_distributed
from tests.frontends.deepspeed.config.test_deepspeed_refuses import deepspeed_initialize_errors
from tests.frontends.deepspeed.deepspeed_side import ONE_RANK, deepspeed_json

SGD = {"type": "SGD", "params": {"lr": 0.1}}


def _config(**blocks: object) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": SGD, "zero_allow_untested_optimizer": True, **blocks}


BF16 = {"enabled": True}
# name -> config; each loads, and the assertion beside it checks how it is read
ACCEPTED = {
    "grad_accum_in_bf16_with_bf16": _config(bf16=BF16, data_types={"grad_accum_dtype": "bf16"}),
    "grad_accum_in_bf16_with_bf16_at_stage_2": _config(bf16=BF16, data_types={"grad_accum_dtype": "bfloat16"},
                                                       zero_optimization={"stage": 2}),
    "grad_accum_in_fp16_with_fp16": _config(fp16={"enabled": True}, data_types={"grad_accum_dtype": "fp16"}),
    "param_dtype_of_the_training_dtype": _config(bf16=BF16, data_types={"param_dtype": "bf16"},
                                                 zero_optimization={"stage": 3}),
    "param_dtype_fp32_in_fp32": _config(data_types={"param_dtype": "fp32"}),
    "optimizer_offload_at_stage_0": _config(zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu"}}),
    "cpu_offload_at_stage_0": _config(zero_optimization={"cpu_offload": True}),
    "summed_gradients_at_stage_0": _config(gradient_allreduce_op="sum"),
    "summed_gradients_at_stage_2": _config(gradient_allreduce_op="SUM", zero_optimization={"stage": 2}),
    "zero_switched_on": _config(zero_optimization=True, allgather_size=1000),
    "zero_switched_off": _config(zero_optimization=False),
    "negative_gradient_clipping": _config(gradient_clipping=-1.0),
    "fp16_ranges_with_fp16_off": _config(fp16={"enabled": False, "loss_scale_window": 0, "hysteresis": 0,
                                               "min_loss_scale": 0, "initial_scale_power": -1}),
    "fp16_ranges_with_a_static_scale": _config(fp16={"enabled": True, "loss_scale": 128, "loss_scale_window": 0,
                                                     "hysteresis": 0, "min_loss_scale": 0,
                                                     "initial_scale_power": 100}),
    "a_first_dynamic_scale_below_1": _config(fp16={"enabled": True, "initial_scale_power": -1}),
    "allgather_bucket_of_0": _config(zero_optimization={"stage": 2, "allgather_bucket_size": 0}),
    "steps_per_print_negative": _config(steps_per_print=-1),
    "steps_per_print_null": _config(steps_per_print=None),
    "bf16_beside_bfloat16": _config(bf16=BF16, bfloat16={"enabled": False}),
    "fp32_allreduce_beside_a_communication_dtype": _config(fp32_allreduce=True, communication_data_type="fp16"),
    "autocast_in_bf16_beside_bf16": _config(bf16=BF16, torch_autocast={"enabled": True, "dtype": "bfloat16"}),
    # optimum-habana's flan-t5 config: DeepSpeed reads the switch as Python's truth
    "torch_adam_written_as_a_string": _config(optimizer={"type": "Adam", "params": {
        "lr": 1e-3, "torch_adam": "torch_impl", "adam_w_mode": False}}),
}
READ_AS = {
    "optimizer_offload_at_stage_0": lambda policies, cfg: policies.zero.offload_optimizer.device == "none",
    "cpu_offload_at_stage_0": lambda policies, cfg: policies.zero.offload_optimizer.device == "none",
    "summed_gradients_at_stage_0": lambda policies, cfg: policies.zero.sum_gradients,
    "summed_gradients_at_stage_2": lambda policies, cfg: policies.zero.sum_gradients,
    "zero_switched_on": lambda policies, cfg: policies.zero.stage == 1 and policies.zero.allgather_bucket_size == 1000,
    "zero_switched_off": lambda policies, cfg: policies.zero.stage == 0,
    "negative_gradient_clipping": lambda policies, cfg: policies.training.gradient_clipping == 0,
    "fp16_ranges_with_a_static_scale": lambda policies, cfg: policies.precision.loss_scaling.initial_scale == 128,
    "a_first_dynamic_scale_below_1": lambda policies, cfg: policies.precision.loss_scaling.initial_scale == 0.5,
    "allgather_bucket_of_0": lambda policies, cfg: policies.zero.allgather_bucket_size >= 2**62,
    "steps_per_print_null": lambda policies, cfg: cfg.steps_per_print is None,
    "bf16_beside_bfloat16": lambda policies, cfg: policies.precision.param_dtype == torch.bfloat16,
    "fp32_allreduce_beside_a_communication_dtype":
        lambda policies, cfg: policies.precision.communication_dtype == torch.float16,
    "autocast_in_bf16_beside_bf16": lambda policies, cfg: policies.precision.autocast
        and policies.precision.param_dtype == policies.precision.autocast_dtype == torch.bfloat16,
    "torch_adam_written_as_a_string": lambda policies, cfg: cfg.optimizer.params["torch_adam"] == "torch_impl",
}
# the data_types DeepSpeed reads and shardwise honours change nothing shardwise does
SAME_AS_WITHOUT_DATA_TYPES = ("grad_accum_in_bf16_with_bf16", "grad_accum_in_bf16_with_bf16_at_stage_2",
                              "grad_accum_in_fp16_with_fp16", "param_dtype_of_the_training_dtype",
                              "param_dtype_fp32_in_fp32")

# DeepSpeed initializes these, but they cannot train (or shardwise cannot do what DeepSpeed does):
# name -> (config, the key shardwise names, words of its reason)
STRICTER = {
    "hysteresis_0_with_dynamic_scaling": (
        _config(fp16={"enabled": True, "hysteresis": 0}), "fp16.hysteresis 0", "never halves the scale"),
    "an_initial_scale_power_above_64": (
        _config(fp16={"enabled": True, "initial_scale_power": 65}), "fp16.initial_scale_power", "is above 64"),
    "steps_per_print_0": (_config(steps_per_print=0), "steps_per_print", "integer modulo by zero"),
    "zenflow_at_stage_0": (_config(zero_optimization={"stage": 0, "zenflow": {"topk_ratio": 0.1}}),
                           "zero_optimization.zenflow at zero_optimization.stage 0", "zenflow_need_update"),
    "lbfgs": (_config(optimizer={"type": "LBFGS", "params": {}}), "optimizer.params", "'closure'"),
    "a_negative_learning_rate": (_config(optimizer={"type": "AdamW", "params": {"lr": -1e-3}}), "optimizer.params.lr",
                                 "greater than or equal to 0"),
    "autocast_without_a_dtype_beside_bf16": (
        _config(bf16=BF16, torch_autocast={"enabled": True}), "torch_autocast.enabled",
        "set torch_autocast.dtype \"bf16\" with bf16"),
    "grad_accum_in_bf16_while_training_in_fp32": (
        _config(data_types={"grad_accum_dtype": "bf16"}, zero_optimization={"stage": 2}),
        "data_types.grad_accum_dtype", "accumulates gradients in the training dtype"),
}
# both refuse: name -> (config, the key shardwise names, DeepSpeed's words in both errors)
BOTH_REFUSE = {
    "a_reduce_bucket_of_0": (_config(zero_optimization={"stage": 2, "reduce_bucket_size": 0}),
                             "zero_optimization.reduce_bucket_size", "greater than 0"),
    "loss_scale_window_0_with_dynamic_scaling": (
        _config(fp16={"enabled": True, "loss_scale_window": 0}), "fp16.loss_scale_window",
        "when dynamic loss scaling is enabled"),
    "min_loss_scale_0_with_dynamic_scaling": (
        _config(fp16={"enabled": True, "min_loss_scale": 0}), "fp16.min_loss_scale",
        "when dynamic loss scaling is enabled"),
    "summed_gradients_at_stage_3": (_config(gradient_allreduce_op="sum", zero_optimization={"stage": 3}),
                                    "gradient_allreduce_op", "is not supported with ZeRO stage 3"),
    "a_param_dtype_other_than_the_training_dtype": (
        _config(bf16=BF16, data_types={"param_dtype": "fp32"}), "data_types.param_dtype",
        "conflicts with the enabled precision mode"),
    "grad_accum_in_fp32_without_zero": (
        _config(bf16=BF16, data_types={"grad_accum_dtype": "fp32"}), "data_types.grad_accum_dtype",
        "unsupported mix of model_dtype"),
    "a_partial_offload_to_the_cpu_at_stage_0": (
        _config(zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}),
        "zero_optimization.offload_optimizer.ratio", "Partial offloading only supported for ZeRO Stage 3"),
    "a_torch_optimizer_in_lower_case": (_config(optimizer={"type": "rmsprop", "params": {}}), "optimizer.type",
                                        "rmsprop"),
}


@pytest.mark.parametrize("name", ACCEPTED)
def test_shardwise_loads_it_as_deepspeed_reads_it(name):
    cfg = load_config(ACCEPTED[name], world_size=2)
    policies = policies_from_config(cfg)
    if name in READ_AS:
        assert READ_AS[name](policies, cfg)
    if name in SAME_AS_WITHOUT_DATA_TYPES:
        without = {key: value for key, value in ACCEPTED[name].items() if key != "data_types"}
        assert policies == policies_from_config(load_config(without, world_size=2))


def test_what_is_ignored_is_said(caplog):
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        for name in ("optimizer_offload_at_stage_0", "zero_switched_on", "bf16_beside_bfloat16",
                     "fp32_allreduce_beside_a_communication_dtype"):
            load_config(ACCEPTED[name], world_size=2)
    assert "'zero_optimization.offload_optimizer.device' 'cpu' at zero_optimization.stage 0" in caplog.text
    assert "'zero_optimization' true: DeepSpeed's deprecated form" in caplog.text
    assert "'bfloat16': 'bf16' is set too" in caplog.text
    assert "'fp32_allreduce' true: DeepSpeed 0.19.8 no longer reads it" in caplog.text


@pytest.mark.parametrize("name", list(STRICTER) + list(BOTH_REFUSE))
def test_shardwise_refuses_it_naming_the_key(name):
    config, key, words = {**STRICTER, **BOTH_REFUSE}[name]
    with pytest.raises(ConfigError) as refused:
        load_config(config, world_size=1)
    assert key in str(refused.value)
    assert words in str(refused.value)  # the reason, or DeepSpeed's own words where it refuses too


def _sum_worker(rank: int, world_size: int, stage: int) -> list[torch.Tensor]:
    import shardwise.frontends.deepspeed.api as deepspeed

    model = _model()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "gradient_allreduce_op": "sum",
              "zero_optimization": {"stage": stage}, "optimizer": SGD}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(3):
        x, y = _batch(step)
        engine.backward(nn.functional.mse_loss(engine(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]))
        engine.step()
    return [parameter.detach().clone() for parameter in engine.module.parameters()]


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    generator = torch.Generator().manual_seed(0)  # the same weights on every rank (threads share torch's seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / 2)
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 4, generator=generator), torch.randn(4, 1, generator=generator)


def test_summed_gradients_train_as_the_sum_of_the_ranks_losses():
    """gradient_allreduce_op "sum" at ZeRO 2 on 2 ranks: one process stepping on the
    gradient of the two ranks' mean losses added (twice the mean's)."""
    result = run_distributed(_sum_worker, 2, 2, timeout=120)[0]
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD["params"]["lr"])
    for step in range(3):
        x, y = _batch(step)
        optimizer.zero_grad()
        (nn.functional.mse_loss(model(x[:2]), y[:2]) + nn.functional.mse_loss(model(x[2:]), y[2:])).backward()
        optimizer.step()
    for got, expected in zip(result, model.parameters()):
        assert ((got - expected).norm() / expected.norm()).item() < 1e-5


class _LossInside(nn.Module):
    """A model that computes its loss, as Hugging Face models do: under CPU autocast the
    loss runs in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x), y)


def _autocast_worker(rank: int, world_size: int, autocast: bool) -> dict:
    import shardwise.frontends.deepspeed.api as deepspeed

    model = _LossInside()
    config = {"train_micro_batch_size_per_gpu": 4, "bf16": BF16, "optimizer": SGD, "zero_optimization": {"stage": 2},
              **({"torch_autocast": {"enabled": True, "dtype": "bf16"}} if autocast else {})}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses, dtypes = [], set()
    for step in range(3):
        loss = engine(*_batch(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        dtypes.add(str(loss.dtype))
    return {"losses": losses, "dtypes": dtypes,
            "params": {str(parameter.dtype) for parameter in engine.module.parameters()}}


def test_bf16_under_bf16_autocast_runs_the_autocast_ops_in_fp32():
    """The bf16 model as without autocast (its parameters bf16), its loss computed in fp32,
    and training close to bf16's (the bf16 tolerance)."""
    plain, autocast = (run_distributed(_autocast_worker, 2, on, timeout=120)[0] for on in (False, True))
    assert plain["params"] == autocast["params"] == {"torch.bfloat16"}
    assert plain["dtypes"] == {"torch.bfloat16"} and autocast["dtypes"] == {"torch.float32"}
    assert autocast["losses"] == pytest.approx(plain["losses"], rel=2e-2)


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to compare with it")
def test_deepspeed_initializes_the_accepted_and_stricter_ones_and_refuses_the_rest():
    configs = {**ACCEPTED, **{name: config for name, (config, _, _) in {**STRICTER, **BOTH_REFUSE}.items()}}
    errors = deepspeed_initialize_errors(configs)
    assert {name: errors[name] for name in list(ACCEPTED) + list(STRICTER)} == dict.fromkeys(
        list(ACCEPTED) + list(STRICTER))
    for name, (_, _, words) in BOTH_REFUSE.items():
        assert errors[name] is not None and words in errors[name], (name, errors[name])


# the autocast run of _autocast_worker under DeepSpeed 0.19.8, on one rank over the same global batch
DEEPSPEED_AUTOCAST_SIDE = """
import json, os, socket, sys, torch, deepspeed
from torch import nn
""" + ONE_RANK + """
deepspeed.init_distributed("gloo")
class LossInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for parameter in self.net.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / 2)
    def forward(self, x, y):
        return nn.functional.mse_loss(self.net(x), y)
model = LossInside()
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=json.loads(sys.argv[1]))
losses = []
for step in range(3):
    generator = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(4, 4, generator=generator), torch.randn(4, 1, generator=generator)
    loss = engine(x.bfloat16(), y.bfloat16())
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
print(json.dumps({"losses": losses, "dtype": str(loss.dtype)}))
"""


@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to compare with it")
def test_deepspeed_trains_bf16_under_bf16_autocast_alike():
    config = {"train_micro_batch_size_per_gpu": 4, "bf16": BF16, "optimizer": SGD, "zero_optimization": {"stage": 2},
              "zero_allow_untested_optimizer": True, "torch_autocast": {"enabled": True, "dtype": "bf16"}}
    deepspeed = deepspeed_json(DEEPSPEED_AUTOCAST_SIDE, json.dumps(config))
    shardwise = run_distributed(_autocast_worker, 2, True, timeout=120)[0]
    assert deepspeed["dtype"] == "torch.float32"
    assert shardwise["losses"] == pytest.approx(deepspeed["losses"], rel=2e-2)
