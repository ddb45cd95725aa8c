"""A LightningModule trained by Lightning's Trainer on 2 CPU processes (launched with
`shardwise run --nproc 2`): `--strategy ddp` (the reference) or a shardwise strategy name
("shardwise_stage_3"). Each rank writes the loss of every micro-batch it trained on to
`--losses PREFIX.rank<R>.json`; `--save PATH` saves the Trainer's checkpoint when fit
ends, `--resume PATH` continues from one."""

import argparse
import json

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardwise.frontends.lightning.strategy  # noqa: F401  (registers the "shardwise_stage_N" names)


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = nn.functional.mse_loss(self.net(inputs), targets)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.01)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--losses", required=True)
    parser.add_argument("--save")
    parser.add_argument("--resume")
    args = parser.parse_args()

    torch.manual_seed(0)
    module = Regression()
    data = torch.Generator().manual_seed(1)
    inputs = torch.randn(20, 8, generator=data)
    dataset = TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).sin())
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=args.strategy, max_epochs=args.epochs,
                         accumulate_grad_batches=2, gradient_clip_val=0.5, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    # 5 batches per rank an epoch: accumulation windows of 2, 2 and 1
    trainer.fit(module, DataLoader(dataset, batch_size=2), ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    with open(f"{args.losses}.rank{trainer.global_rank}.json", "w") as file:
        json.dump(module.losses, file)
    # Lightning leaves the process group to interpreter teardown, where gloo can abort the
    # process after its work is done (std::terminate); the DDP reference never reaches
    # shardwise's own at-exit destroy (runtime/distributed/setup.py), so it is done here.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
