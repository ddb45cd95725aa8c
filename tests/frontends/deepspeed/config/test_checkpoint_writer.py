"""DeepSpeed 0.19.8's `checkpoint` block: `writer.decoupled` (its background checkpoint
engine) is shardwise's asynchronous save; the writer's I/O knobs are accepted as harmless;
a mock writer (no files) and values DeepSpeed's parser refuses are refused."""

import pytest
import torch

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.frontends.deepspeed.config import ConfigError, load_config
from shardwise.frontends.deepspeed.config.policies import policies_from_config


def asynchronous(checkpoint: dict | None) -> bool:
    config = {"train_batch_size": 2} | ({} if checkpoint is None else {"checkpoint": checkpoint})
    return policies_from_config(load_config(config, world_size=1)).checkpoint.asynchronous


def problems_of(checkpoint: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config({"train_batch_size": 2, "checkpoint": checkpoint}, world_size=1)
    return caught.value.problems


@pytest.mark.parametrize(("checkpoint", "expected"), [
    (None, False),
    ({"tag_validation": "Fail"}, False),
    ({"writer": None}, False),
    ({"writer": {}}, False),
    ({"writer": {"decoupled": False}}, False),
    ({"writer": {"decoupled": True}}, True),
    ({"writer": {"type": "FAST", "decoupled": True, "io_buffer_size": 64e6, "io_buffer_double": True,
                 "show_statistics": False, "data_parallel": "socket", "io_multiplier": 2}}, True),
    ({"checkpoint_serialization": False, "load_universal": True, "use_node_local_storage": True,
      "parallel_write": {"pipeline_stage": True}, "writer": {"type": "python"}}, False),
])
def test_decoupled_writer_is_the_asynchronous_save(checkpoint, expected):
    assert asynchronous(checkpoint) is expected


@pytest.mark.parametrize(("checkpoint", "expected"), [
    ({"writer": {"type": "mock"}}, "'checkpoint.writer.type' \"mock\" is not supported: DeepSpeed's mock writer "
                                   "writes no files"),
    ({"writer": {"type": "bogus"}}, "'checkpoint.writer.type' \"bogus\" is not supported"),
    ({"writer": {"data_parallel": "rack"}}, "'checkpoint.writer.data_parallel' \"rack\" is not supported"),
    ({"writer": {"decoupeld": True}}, "unknown key 'checkpoint.writer.decoupeld'; did you mean "
                                      "'checkpoint.writer.decoupled'?"),
    ({"writer": {"decoupled": "yes"}}, "checkpoint.writer.decoupled"),
    ({"tag_validation": "sometimes"}, "checkpoint.tag_validation"),
])
def test_what_deepspeed_refuses_or_shardwise_cannot_do_is_refused(checkpoint, expected):
    (problem,) = problems_of(checkpoint)
    assert expected in problem


def test_a_decoupled_writer_saves_in_the_background_and_the_checkpoint_loads(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "checkpoint": {"writer": {"decoupled": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    engine.backward(engine(torch.randn(2, 3)).sum())
    engine.step()
    assert engine.policies.checkpoint.asynchronous
    engine.save_checkpoint(tmp_path, tag="one")
    saved = {name: param.detach().clone() for name, param in model.named_parameters()}
    engine.wait_for_checkpoint()
    engine.backward(engine(torch.randn(2, 3)).sum())
    engine.step()
    engine.load_checkpoint(tmp_path, tag="one")
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), saved[name]), name
    engine.destroy()
