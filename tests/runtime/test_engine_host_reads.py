"""`engine.step()` reads the device from the host a fixed number of times, however many
parameters the model has: on CUDA each read (`.item()`, `.tolist()`, `.cpu()`, `float()`
of a tensor...) waits for every kernel queued before it, so one per parameter would stall
the step once per parameter. Counted here on the CPU, where the same calls are made.

Optimizer step counters are left out of the count: they live in host memory (as in
torch's own optimizers), so reading them waits for nothing."""

from collections import Counter

import pytest
import torch
from torch import nn

import shardwise
from shardwise.tools.testing import run_distributed

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")
OPTIMIZERS = {
    "AdamW": {"type": "AdamW", "params": {"lr": 1e-3}},
    "Adafactor": {"type": "Adafactor", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "OneBitLamb": {"type": "OneBitLamb", "params": {"lr": 1e-3, "weight_decay": 0.01, "freeze_step": 1}},
}
# the step check's read of the local norm and loss flag, and of the agreed totals (host memory);
# Adafactor reads every parameter's weight and update norms at once, for torch's host-scalar step size;
# 1-bit LAMB (compressed phase) its variance factors' maxima and its norms, each for every parameter at once
EXPECTED = {"AdamW": 2, "Adafactor": 3, "OneBitLamb": 4}
CASES = [(optimizer, stage) for optimizer in sorted(OPTIMIZERS) for stage in (0, 1, 2, 3)
         if not (optimizer == "OneBitLamb" and stage == 3)]  # 1-bit optimizers run at stages 0-2


class Stack(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def reads_in_one_step(optimizer: str, stage: int, layers: int, monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Host reads of tensors during the third `engine.step()` (state already built)."""
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "optimizer": OPTIMIZERS[optimizer],
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine = shardwise.initialize(Stack(layers), config)
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(engine.rank))
    for _ in range(2):
        engine.backward(engine(x))
        engine.step()
    engine.backward(engine(x))
    counters = {id(state["step"]) for state in engine.optimizer.optimizer.state.values() if "step" in state}
    reads: Counter = Counter()
    with monkeypatch.context() as patch:
        for name in READS:
            patch.setattr(torch.Tensor, name, _counted(getattr(torch.Tensor, name), name, counters, reads))
        engine.step()
    return reads


def _counted(read, name: str, excluded: set[int], reads: Counter):
    def counted(tensor, *args, **kwargs):
        if id(tensor) not in excluded:
            reads[name] += 1
        return read(tensor, *args, **kwargs)

    return counted


@pytest.mark.parametrize(("optimizer", "stage"), CASES)
def test_a_step_reads_the_device_a_fixed_number_of_times(optimizer, stage, monkeypatch):
    small = reads_in_one_step(optimizer, stage, 2, monkeypatch)
    large = reads_in_one_step(optimizer, stage, 8, monkeypatch)  # 16 parameters instead of 4
    assert small == large
    assert sum(small.values()) == EXPECTED[optimizer], small


def _reads_on_ranks(rank: int, world_size: int) -> list[int]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        return [sum(reads_in_one_step("Adafactor", 3, layers, monkeypatch).values()) for layers in (2, 8)]


def test_sharded_adafactor_reads_a_fixed_number_of_times_on_every_rank():
    """Sums over the group go through host memory (the gloo control group): the step
    check's (its payload is there already) and Adafactor's two add a `.cpu()` each, for
    any number of parameters."""
    for small, large in run_distributed(_reads_on_ranks, 2):
        assert small == large == EXPECTED["Adafactor"] + 3
