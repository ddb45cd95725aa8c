"""Optimizers by config name with their K (bytes of state per parameter, docs/formulas.md#optimizer-state-bytes-k), and the
codec through which their state is checkpointed."""

import pytest
import torch

from shardwise.frontends.deepspeed.config.params import OPTIMIZER_PARAMS
from shardwise.runtime.optim import ElementwiseCodec, optimizer_spec, registered_optimizers


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
    with pytest.raises(ValueError, match="no optimizer 'Lion'; registered: Adafactor, Adam, Adam8bit, AdamW, "
                                         "AdamW8bit, Lamb, Lars, Muon, OneBitAdam, OneBitLamb, SGD"):
        optimizer_spec("Lion")


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
