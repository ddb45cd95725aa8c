"""`optimizer.parameter_offload` at ZeRO-3 (api/runtime/zero/parameter_offload.py), driven by
TRL's own `remove_hooks` / `add_hooks` as its `unwrap_model_for_generation` drives them
under DeepSpeed: every parameter gathered, the hooks removed, each rank runs its own
number of forwards without gradients (ranks whose completions end at different lengths),
the hooks back; then training goes on. On 2 ranks: the forwards inside equal the gathered
model's, and the final weights equal (bit for bit) the same training without the block.
A forward with gradients while the hooks are away is refused, naming why."""

from __future__ import annotations

import pytest
import torch

from shardwise.tools.testing import run_distributed

pytest.importorskip("trl", reason="TRL's remove_hooks / add_hooks need the trl extra")

CONFIG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3,
                                                                     "stage3_param_persistence_threshold": 0},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def _train(rank: int, world_size: int, generating: bool) -> dict:
    import shardwise.frontends.deepspeed.api as deepspeed
    from trl.models.utils import add_hooks, remove_hooks

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    engine, optimizer, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    probe = torch.linspace(-1, 1, 8).reshape(2, 4)
    result: dict = {}

    def step(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        x, y = torch.randn(2, 4, generator=generator), torch.randn(2, 4, generator=generator)
        engine.backward(torch.nn.functional.mse_loss(engine(x + rank), y))
        engine.step()

    step(0)
    if generating:
        assert engine.optimizer.parameter_offload is optimizer.parameter_offload
        with torch.no_grad():
            result["hooked"] = engine(probe).tolist()
        with deepspeed.zero.GatheredParameters(model.parameters()):
            remove_hooks(engine)
            with torch.no_grad():  # rank r runs r + 1 forwards: no collective may pair them
                result["inside"] = [engine.module(probe).tolist() for _ in range(rank + 1)]
            with pytest.raises(RuntimeError, match="forward with gradients while the stage-3 hooks stand aside"):
                engine.module(probe)
            add_hooks(engine)
    for seed in (1, 2):
        step(seed)
    with deepspeed.zero.GatheredParameters(model.parameters()):
        result["weights"] = [p.detach().clone() for p in model.parameters()]
    return result


def test_trl_generation_block_leaves_training_as_it_was():
    generated = run_distributed(_train, 2, True)
    plain = run_distributed(_train, 2, False)
    for rank, (mine, reference) in enumerate(zip(generated, plain)):
        assert len(mine["inside"]) == rank + 1
        assert all(output == mine["hooked"] for output in mine["inside"])
        for weight, want in zip(mine["weights"], reference["weights"]):
            assert torch.equal(weight, want)


def _refuses_another_module(rank: int, world_size: int) -> None:
    import shardwise.frontends.deepspeed.api as deepspeed

    model = torch.nn.Linear(4, 4)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    assert all(param.ds_active_sub_modules == set() for param in model.parameters())
    with pytest.raises(ValueError, match="registers the hooks of the model it was built with only"):
        engine.optimizer.parameter_offload._register_deepspeed_module(torch.nn.Linear(2, 2))


def test_hooks_go_back_on_the_engines_model_only():
    run_distributed(_refuses_another_module, 1)
