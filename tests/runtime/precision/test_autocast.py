"""DeepSpeed's `torch_autocast` and `fp16.auto_cast`, as the engine runs them.

torch_autocast: the forward runs under `torch.autocast(dtype)` while the parameters, their
gradients and the optimizer stay fp32, so training equals plain PyTorch doing the same.
fp16.auto_cast: the forward's floating-point inputs arrive in fp16."""

import pytest
import torch
from torch import nn

import shardwise


class Recorder(nn.Module):
    """Two linear layers; remembers the dtypes its forward saw."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 1)
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen["input"] = x.dtype
        hidden = self.first(x)
        self.seen["linear output"] = hidden.dtype
        return self.second(torch.relu(hidden)).float().pow(2).mean()


def config(**blocks) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-4}},
            **blocks}


@pytest.mark.parametrize("dtype", ["bfloat16", None], ids=["bf16", "device-default"])
def test_forward_runs_under_autocast_from_fp32_parameters(dtype):
    block = {"enabled": True, **({"dtype": dtype} if dtype else {})}
    model = Recorder()
    reference = Recorder()
    engine = shardwise.initialize(model, config(torch_autocast=block))
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-4)
    torch.manual_seed(1)
    for step in range(3):
        x = torch.randn(4, 8)
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # torch's default on CPU is bf16
            expected = reference(x)
        expected.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:  # the same weights: the same bf16 computation
            assert loss.item() == expected.item()
        assert loss.item() == pytest.approx(expected.item(), rel=2e-2)
    assert model.seen == {"input": torch.float32, "linear output": torch.bfloat16}
    assert all(param.dtype == torch.float32 for param in model.parameters())
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert ((mine - theirs).norm() / theirs.norm()).item() < 2e-2
    engine.destroy()


def test_without_torch_autocast_the_forward_computes_in_fp32():
    model = Recorder()
    engine = shardwise.initialize(model, config())
    engine(torch.randn(4, 8))
    assert model.seen == {"input": torch.float32, "linear output": torch.float32}
    engine.destroy()


def test_fp16_auto_cast_casts_the_forwards_inputs():
    model = Recorder()
    engine = shardwise.initialize(model, config(fp16={"enabled": True, "auto_cast": True}))
    engine(torch.randn(4, 8))
    assert model.seen == {"input": torch.float16, "linear output": torch.float16}
    engine.destroy()
