"""A Lightning Fabric training loop on 2 CPU processes (launched with `shardwise run
--nproc 2`): `--strategy ddp` (the reference) or `--strategy shardwise_stage_N`, which
runs the same loop on `ShardwiseFabricStrategy(stage=N)`. Accumulation windows of 2
micro-batches through `fabric.no_backward_sync` (each epoch's last window has 1), the
gradient clipped to norm 0.5 (`fabric.clip_gradients` under DDP, the config's
`gradient_clipping` on shardwise), AdamW with weight decay, a StepLR stepped by the loop
each epoch. Each rank writes the loss of every micro-batch and the final full weights to
`--out PREFIX.rank<R>.json`; `--save PATH` saves with `fabric.save` after the last
epoch, `--resume PATH` continues from one with `fabric.load`."""

import argparse
import json

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise.frontends.lightning.fabric import ShardwiseFabricStrategy

ACCUMULATION = 2
MAX_NORM = 0.5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--save")
    parser.add_argument("--resume")
    args = parser.parse_args()

    shardwise_stage = int(args.strategy.removeprefix("shardwise_stage_")) if args.strategy != "ddp" else None
    strategy = ("ddp" if shardwise_stage is None
                else ShardwiseFabricStrategy(stage=shardwise_stage, config={"gradient_clipping": MAX_NORM}))
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    model, optimizer = fabric.setup(model, optimizer)
    data = torch.Generator().manual_seed(1)
    inputs = torch.randn(20, 8, generator=data)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).sin()),
                                                 batch_size=2))  # 5 batches per rank an epoch

    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "epoch": 0}
    if args.resume:
        fabric.load(args.resume, state)
    losses = []
    for epoch in range(state["epoch"], args.epochs):
        loader.sampler.set_epoch(epoch)
        for index, (batch, targets) in enumerate(loader):
            window_end = (index + 1) % ACCUMULATION == 0 or index + 1 == len(loader)
            window = min(ACCUMULATION, len(loader) - index // ACCUMULATION * ACCUMULATION)
            with fabric.no_backward_sync(model, enabled=not window_end):
                loss = nn.functional.mse_loss(model(batch), targets)
                fabric.backward(loss / window)
            losses.append(loss.item())
            if window_end:
                if shardwise_stage is None:
                    fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)
                optimizer.step()
                optimizer.zero_grad()
        scheduler.step()
        state["epoch"] = epoch + 1
    if args.save:
        fabric.save(args.save, state)

    module = model.module
    params = list(module.parameters())
    with shardwise.gathered_parameters(params) if shardwise_stage is not None else torch.no_grad():
        weights = {name: param.detach().flatten().tolist() for name, param in module.named_parameters()}
    with open(f"{args.out}.rank{fabric.global_rank}.json", "w") as file:
        json.dump({"losses": losses, "weights": weights}, file)
    # Lightning leaves the process group to interpreter teardown, where gloo can abort the
    # process after its work is done (std::terminate); the DDP reference never reaches
    # shardwise's own at-exit destroy (runtime/distributed/setup.py), so it is done here.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
