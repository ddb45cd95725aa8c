"""DeepSpeed's `offload_states` / `reload_states` as RLHF loops call them: OpenRLHF's set
of states offloaded through the ZeRO optimizer (`engine.optimizer.offload_states(include=
[...], device=OffloadDeviceEnum.cpu, ...)`), `empty_partition_cache()`, a forward, the
engine's `reload_states()`, then everything offloaded and reloaded through the engine.
At ZeRO stages 1 (fp32), 2 (bf16) and 3 (both), one rank: the weights equal (bit for bit) the same
training without the offloads, and with DEEPSPEED_PYTHON, DeepSpeed 0.19.8's own
weights and forward output (< 1e-5; DeepSpeed runs the same script on its CPU
accelerator). The runtime's side (every kind, what moves, the refusals) is
tests/runtime/engine/test_offload_states.py."""

from __future__ import annotations

import pytest
import torch

from shardwise.tools.testing import run_distributed
from tests.frontends.deepspeed.deepspeed_side import deepspeed_trains, needs_deepspeed

# one rank's training, run by shardwise's `deepspeed` module and by DeepSpeed 0.19.8's alike
TRAIN = """
import torch
from torch import nn


def train(deepspeed, offload_config, config, offloading=True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    engine, optimizer, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    states = offload_config.OffloadStateTypeEnum
    dtype = torch.bfloat16 if config["bf16"]["enabled"] else torch.float32
    seen = []

    def steps(first, count):
        for step in range(first, first + count):
            generator = torch.Generator().manual_seed(step)
            x, y = torch.randn(2, 8, generator=generator), torch.randn(2, 8, generator=generator)
            engine.backward(nn.functional.mse_loss(engine(x.to(dtype)).float(), y))
            engine.step()

    steps(0, 2)
    if offloading:  # around generation: OpenRLHF's states, offloaded through the engine's ZeRO optimizer
        assert engine.optimizer.offload_states == optimizer.offload_states
        engine.optimizer.offload_states(include=[states.optim_states, states.contiguous_grad_buffer, states.hp_params],
                                 device=offload_config.OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=True)
        engine.empty_partition_cache()
    with torch.no_grad():
        seen.append(engine(torch.ones(2, 8, dtype=dtype)).float().flatten().tolist())
    if offloading:
        engine.reload_states(non_blocking=True)
    steps(2, 2)
    if offloading:
        engine.offload_states()
        engine.reload_states()
    steps(4, 1)
    weights = [p.detach().float().clone() for p in model.parameters()]
    if config["zero_optimization"]["stage"] == 3:
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            weights = [p.detach().float().clone() for p in model.parameters()]
    return {"weights": [w.flatten().tolist() for w in weights], "seen": seen}
"""

CONFIGS = {f"stage_{stage}_{'bf16' if bf16 else 'fp32'}": {
    "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}} for stage, bf16 in ((1, False), (2, True),
                                                                                     (3, False), (3, True))}


def _shardwise_runs(rank: int, world_size: int, offloading: bool) -> dict[str, dict]:
    import shardwise.frontends.deepspeed.api as deepspeed
    from shardwise.frontends.deepspeed.api.runtime.zero import offload_config

    scope: dict = {}
    exec(TRAIN, scope)
    return {name: scope["train"](deepspeed, offload_config, config, offloading) for name, config in CONFIGS.items()}


def test_the_states_come_back_as_they_left():
    moved = run_distributed(_shardwise_runs, 1, True)[0]
    plain = run_distributed(_shardwise_runs, 1, False)[0]
    assert moved == plain


def _refuses_other_devices(rank: int, world_size: int) -> None:
    import shardwise.frontends.deepspeed.api as deepspeed

    model = torch.nn.Linear(4, 4)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=CONFIGS["stage_3_fp32"])
    with pytest.raises(ValueError, match="NVMe offload is not supported for offloading states"):
        engine.offload_states(device="nvme")
    engine.offload_states(device="none")  # DeepSpeed's warning, nothing moved
    assert not engine.offloaded_states


def test_only_the_host_takes_the_states():
    run_distributed(_refuses_other_devices, 1)


@needs_deepspeed
def test_deepspeed_offloads_and_trains_alike():
    ours = run_distributed(_shardwise_runs, 1, True)[0]
    theirs = deepspeed_trains(TRAIN, CONFIGS, "train(deepspeed, offload_config, config)",
                              imports="from deepspeed.runtime.zero import offload_config")
    for name, run in ours.items():
        for mine, reference in zip(run["weights"] + run["seen"], theirs[name]["weights"] + theirs[name]["seen"]):
            mine, reference = torch.tensor(mine), torch.tensor(reference)
            assert ((mine - reference).norm() / reference.norm()).item() < 1e-5, name
