"""`deepspeed.tp_model_init` / `set_autotp_mode` (api/autotp.py), as DeepSpeed 0.19.8's: the
first records the size and returns the model as it is, `initialize` refuses a config that
splits the model over another size, a `tp_group` is refused; the second switches nothing.
A stock Trainer with an AutoTP config, which calls them: tests/frontends/hf_trainer/test_stock_trainer.py."""

import pytest
import torch

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.tools.testing import run_distributed


def test_tp_model_init_records_and_returns_the_model():
    model = torch.nn.Linear(4, 4)
    assert deepspeed.tp_model_init(model, tp_size=2, dtype=torch.float32) is model
    assert deepspeed.tp_model_init(model, 2, torch.float32, config={"tensor_parallel": {"autotp_size": 2}}) is model
    with pytest.raises(ValueError, match="tp_size=2.*autotp_size 4 differ"):
        deepspeed.tp_model_init(model, 2, torch.float32, config={"tensor_parallel": {"autotp_size": 4}})
    with pytest.raises(ValueError, match="tp_group"):
        deepspeed.tp_model_init(model, 2, torch.float32, tp_group=object())
    assert deepspeed.set_autotp_mode(training=True) is None


def _initialize_recorded(rank: int, world_size: int) -> str:
    model = deepspeed.tp_model_init(torch.nn.Linear(4, 4), tp_size=2, dtype=torch.float32)
    with pytest.raises(ValueError, match="recorded tp_size 2, but the config splits the model over 1") as refused:
        deepspeed.initialize(model=model, model_parameters=model.parameters(),
                             config={"train_micro_batch_size_per_gpu": 1,
                                     "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    return str(refused.value)


def test_initialize_refuses_a_config_without_the_recorded_split():
    run_distributed(_initialize_recorded, 1)
