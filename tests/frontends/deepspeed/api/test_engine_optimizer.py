"""`engine.optimizer.param_groups`: scripts and DeepSpeed's own tests read and set the
learning rate through the engine's optimizer; under ZeRO that is shardwise's sharded
optimizer, whose groups are the wrapped torch optimizer's (the one `initialize` returns)."""

import torch
from torch import nn

from shardwise.tools.testing import run_distributed


def _lr_through_engine_optimizer(rank: int, world_size: int, stage: int) -> dict:
    import shardwise.frontends.deepspeed.api as deepspeed

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1,
                                                           "warmup_num_steps": 10}}}
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config=config,
                                                           model_parameters=model.parameters())
    same_groups = engine.optimizer.param_groups is optimizer.param_groups
    lrs_before = [group["lr"] for group in engine.optimizer.param_groups]
    for group in engine.optimizer.param_groups:  # a script switching learning off through the engine
        group["lr"] = 0.0
    before = [parameter.detach().clone() for parameter in engine.module.parameters()]
    loss = engine(torch.ones(2, 4)).square().sum()
    engine.backward(loss)
    engine.step()
    unchanged = all(torch.equal(old, new.detach()) for old, new in zip(before, engine.module.parameters()))
    return {"same_groups": same_groups, "lrs_before": lrs_before, "scheduled": scheduler.get_lr(),
            "unchanged": unchanged, "lr_after_step": [group["lr"] for group in optimizer.param_groups]}


def test_engine_optimizer_param_groups_are_the_optimizers():
    report = run_distributed(_lr_through_engine_optimizer, 1, 2, timeout=60)[0]
    assert report["same_groups"]
    assert report["lrs_before"] == [0.01]  # the warm-up's first rate, written at construction
    assert report["unchanged"]  # the lr set through engine.optimizer is the one the step used
    assert report["lr_after_step"] == report["scheduled"]  # then the schedule's next rate
