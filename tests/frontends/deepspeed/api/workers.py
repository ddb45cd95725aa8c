"""Rank functions for tests/frontends/deepspeed/api/test_api.py (run by `run_distributed`, 2 ranks).

`train_through_api` drives `deepspeed.initialize` the way DeepSpeed scripts do (config
file from `--deepspeed_config`, param groups with their own hyper-parameters, training
data turned into the engine's loader, gradient accumulation) and computes, on every
rank, the plain-PyTorch reference over the same global batches; the test compares.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from torch import nn

import shardwise.frontends.deepspeed.api as deepspeed

ROWS, FEATURES, MICRO, ACCUMULATION, LR, DECAY, BIAS_LR = 32, 6, 2, 2, 0.01, 0.1, 0.05


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(FEATURES, 8)
        self.out = nn.Linear(8, 1)
        self.tag = "the user's model"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x))).squeeze(-1)

    def describe(self) -> str:
        return f"{self.tag} with {sum(p.numel() for p in self.parameters())} parameters"


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(ROWS, FEATURES, generator=generator)
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=False).sin())


def groups(model: Regressor) -> list[dict]:
    weights = [param for name, param in model.named_parameters() if name.endswith("weight")]
    biases = [param for name, param in model.named_parameters() if name.endswith("bias")]
    return [{"params": weights, "weight_decay": DECAY}, {"params": biases, "weight_decay": 0.0, "lr": BIAS_LR}]


def config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUMULATION,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        "wall_clock_breakdown": False,
    }


def reference_weights(world_size: int, updates: int) -> dict[str, torch.Tensor]:
    """Plain torch: every rank's micro-batches (DistributedSampler shares), averaged."""
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.AdamW([dict(group, lr=group.get("lr", LR)) for group in groups(model)], lr=LR)
    data = dataset()
    shares = [list(torch.utils.data.DistributedSampler(data, num_replicas=world_size, rank=r)) for r in range(world_size)]
    for update in range(updates):
        for micro in range(ACCUMULATION):
            total = 0
            for share in shares:
                rows = share[(update * ACCUMULATION + micro) * MICRO:][:MICRO]
                x, y = data[rows]
                total = total + nn.functional.mse_loss(model(x), y) / (world_size * ACCUMULATION)
            total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def train_through_api(rank: int, world_size: int, stage: int, directory: str) -> dict:
    directory = Path(directory)
    config_path = directory / f"ds_config_{stage}.json"
    if rank == 0:
        config_path.write_text(json.dumps(config(stage)))
    torch.distributed.barrier()
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(config_path)])
    torch.manual_seed(0)
    model = Regressor()
    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=model, model_parameters=groups(model),
                                                                training_data=dataset())
    seen_rows = [int(row) for row in loader.sampler]
    report = {
        "local_rank_arg": args.local_rank,
        "group_hyper": [(group["lr"], group["weight_decay"]) for group in optimizer.param_groups],
        "accessors": (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                      engine.gradient_accumulation_steps(), int(engine.gradient_accumulation_steps),
                      engine.zero_optimization_stage(), engine.fp16_enabled(), engine.bfloat16_enabled(),
                      engine.local_rank, engine.global_rank, engine.world_size),
        "parallel_accessors": (engine.get_batch_info(), engine.get_data_parallel_rank(),
                               engine.get_tensor_parallel_rank(), engine.get_model_parallel_rank(),
                               engine.get_sequence_parallel_group()),
        "passthrough": (engine.tag, engine.describe(), isinstance(engine, nn.Module),
                        len(list(engine.parameters())) == len(list(model.parameters()))),
        "rows": seen_rows,
        "batch_sizes": [],
        "applied": [],
    }
    engine.train()
    updates = 0
    for x, y in loader:
        report["batch_sizes"].append(len(x))
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        report["applied"].append(engine.was_step_applied())
        updates += engine.was_step_applied()
        if updates == 3:
            break
    report["grad_norm"] = engine.get_global_grad_norm()
    engine.eval()
    report["modes"] = (engine.training, model.training)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        report["weights"] = {name: param.detach().clone() for name, param in model.named_parameters()}
    report["reference"] = reference_weights(world_size, updates)
    report.update(_checkpoints(engine, model, scheduler, directory / f"checkpoints_{stage}"))
    report.update(_sixteen_bit_model(engine, directory / f"model_{stage}"))
    report.update(_comm(rank))
    return report


def _checkpoints(engine, model, scheduler, directory: Path) -> dict:
    saved = engine.save_checkpoint(directory, tag="first", client_state={"epoch": 3})
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    engine.save_checkpoint(directory, tag="second", save_latest=False)
    latest_after_second = (directory / "latest").read_text().strip()
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if torch.distributed.get_rank() == 0:
            for param in model.parameters():
                param.data.add_(1.0)
    path, client_state = engine.load_checkpoint(directory)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        restored = all(torch.equal(param, before[name]) for name, param in model.named_parameters())
    path_not_strict, _ = engine.load_checkpoint(directory, load_module_strict=False)  # the same model: as strict
    refusals = []
    try:
        engine.load_checkpoint(directory, custom_load_fn=lambda **kwargs: None)
    except ValueError as error:
        refusals.append(str(error))
    missing = engine.load_checkpoint(directory / "nothing_here")
    return {"saved": saved, "latest_after_second": latest_after_second, "loaded_path": path,
            "client_state": client_state, "restored": restored, "refusals": refusals, "missing": missing,
            "loaded_path_not_strict": path_not_strict}


def _sixteen_bit_model(engine, directory: Path) -> dict:
    written = engine.save_16bit_model(directory, "weights.bin")
    state = torch.load(directory / "weights.bin") if written else {}
    legacy = engine.save_fp16_model(directory / "legacy")  # DeepSpeed's older name, its default file name
    legacy_state = torch.load(directory / "legacy" / "pytorch_model.bin") if legacy else {}
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        whole = {name: param.detach().clone() for name, param in engine.module.named_parameters()}
    return {"sixteen_bit_written": written and legacy,
            "sixteen_bit_equal": all(sorted(saved) == sorted(whole) and all(torch.equal(saved[k], whole[k])
                                                                             for k in whole)
                                     for saved in (state, legacy_state))}


def _comm(rank: int) -> dict:
    dist = deepspeed.comm
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    value = torch.tensor([float(rank * 10 + 7)])
    dist.broadcast(value, src=1)
    gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    dist.barrier()
    return {"comm": (dist.get_rank(), dist.get_world_size(), dist.get_local_rank(), total.item(), value.item(),
                     [tensor.item() for tensor in gathered], dist.is_initialized())}


def client_optimizer_wins(rank: int, world_size: int) -> dict:
    """A passed optimizer (here a callable, as DeepSpeed allows) wins over the config's
    block; a passed lr_scheduler over the config's scheduler."""
    torch.manual_seed(0)
    model = Regressor()
    built = {}

    def make_optimizer(params):
        built["groups"] = len(params)
        return torch.optim.SGD(model.parameters(), lr=0.5)

    scheduler = lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # noqa: E731
    cfg = {"train_batch_size": 2 * world_size, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    engine, optimizer, loader, lr_scheduler = deepspeed.initialize(model=model, optimizer=make_optimizer,
                                                                   lr_scheduler=scheduler, config_params=cfg)
    x = torch.randn(2, FEATURES)
    engine.backward(engine(x).square().mean())
    engine.step()
    return {"optimizer": type(optimizer).__name__, "scheduler": type(lr_scheduler).__name__, "loader": loader,
            "lr_after_step": optimizer.param_groups[0]["lr"], "callable_got": built["groups"],
            "env_local_rank": int(os.environ["LOCAL_RANK"])}
