"""Lightning Fabric's own DeepSpeedStrategy, run unchanged on shardwise by `shardwise run
--as-deepspeed --nproc 2` (the strategy's `import deepspeed` finds the compatibility
package): train a few steps, `fabric.save`, train on and record the losses; then set up a
fresh model and optimizer, `fabric.load` the checkpoint (Lightning's load_checkpoint
checks the optimizer against deepspeed.runtime.base_optimizer.DeepSpeedOptimizer) and
train the same steps again. Writes `--out PREFIX.rank<R>.json`: the losses after the
save, the losses after the load, and the step the loaded client state holds.

Lightning's strategy refuses any accelerator but CUDA in `setup_environment` and checks
the CUDA device indices in `_setup_distributed`; on this CPU-only test machine those two
checks are skipped (a mock for CUDA, which cannot run here), and nothing else of the
strategy is changed.
"""

import argparse
import json
from unittest import mock

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy
from torch import nn

STEPS_BEFORE, STEPS_AFTER = 2, 3


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    def setup_environment(self) -> None:
        """DeepSpeedStrategy's without its two CUDA-only checks (module docstring)."""
        with mock.patch("lightning.fabric.strategies.deepspeed._validate_device_index_selection"):
            DDPStrategy.setup_environment(self)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    inputs = torch.randn(4, 8, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True).sin()


def build(fabric: Fabric) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.01)
    return fabric.setup(model, optimizer)


def train(fabric: Fabric, model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        inputs, targets = batch(step, fabric.global_rank)
        loss = nn.functional.mse_loss(model(inputs), targets)
        fabric.backward(loss, model=model)  # Lightning asks for it once a script has set up two models
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    fabric = Fabric(accelerator="cpu", devices=2, strategy=CPUDeepSpeedStrategy(stage=args.stage))
    fabric.launch()

    model, optimizer = build(fabric)
    train(fabric, model, optimizer, range(STEPS_BEFORE))
    fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer, "step": STEPS_BEFORE})
    continued = train(fabric, model, optimizer, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))

    model, optimizer = build(fabric)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(args.checkpoint, state)
    resumed = train(fabric, model, optimizer, range(state["step"], state["step"] + STEPS_AFTER))
    with open(f"{args.out}.rank{fabric.global_rank}.json", "w") as file:
        json.dump({"continued": continued, "resumed": resumed, "step": state["step"]}, file)


if __name__ == "__main__":
    main()
