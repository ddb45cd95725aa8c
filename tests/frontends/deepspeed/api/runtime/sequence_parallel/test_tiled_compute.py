"""ALST's tiled computations equal the untiled ones: outputs, the input's gradient and the
weights' gradients (fp64, so the tolerance is not the sums' order), with tiles that do
not divide the sequence, a batch of two, and a loss scaled after the tiled function (where
DeepSpeed's TiledFusedLogitsLoss would leave the weights' gradient unscaled)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.frontends.deepspeed.api.runtime.sequence_parallel.ulysses_sp import (
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(6, 20), nn.Linear(20, 6)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def gradients(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad.clone()] + [p.grad.clone() for p in module.parameters()]


def run(compute, module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    module.zero_grad()
    x = x.clone().requires_grad_()
    out = compute(x)
    (out * 3.0).sum().backward()  # a factor after the function: its gradient is not 1
    return out.detach(), gradients(module, x)


def assert_same(tiled, whole):
    assert torch.allclose(tiled[0], whole[0], rtol=1e-12, atol=1e-12)
    for got, want in zip(tiled[1], whole[1], strict=True):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.fixture
def mlp() -> Mlp:
    torch.manual_seed(0)
    return Mlp().double()


def test_tiled_mlp(mlp):
    x = torch.randn(2, 7, 6, dtype=torch.float64)
    params = list(mlp.parameters())
    tiled = run(lambda x: TiledMLP.apply(lambda m, t: m(t), mlp, x, 3, params), mlp, x)
    assert_same(tiled, run(mlp, mlp, x))
    assert all(p.ds_grad_is_ready for p in params)  # DeepSpeed's mark: ready after the last tile


@pytest.mark.parametrize("reduction", [None, "mean", "sum"])
def test_sequence_tiled_compute(mlp, reduction):
    """Tiles of ceil(7 / 3) = 3 positions (3, 3, 1); `scale` passed whole to every tile."""
    x = torch.randn(2, 7, 6, dtype=torch.float64)

    def fn(hidden, scale):
        return mlp(hidden) * scale

    def reduce(out):
        return out if reduction is None else getattr(out, reduction)()

    tiled = run(lambda x: sequence_tiled_compute(fn, 7, 3, {"hidden": x}, {"scale": 0.5}, "hidden",
                                                 list(mlp.parameters()), 1, reduction), mlp, x)
    assert_same(tiled, run(lambda x: reduce(fn(x, 0.5)), mlp, x))


def test_sequence_tiled_compute_loss_per_tile(mlp):
    """Output dimension 0: one loss per tile, their mean (the loss use)."""
    x = torch.randn(1, 8, 6, dtype=torch.float64)
    tiled = run(lambda x: SequenceTiledCompute.apply(lambda hidden: mlp(hidden).square().mean(), 8, 4, ["hidden"], [],
                                                     "hidden", None, 0, "mean", x), mlp, x)
    whole = run(lambda x: torch.stack([mlp(t).square().mean() for t in x.split(2, 1)]).mean(), mlp, x)
    assert_same(tiled, whole)


@pytest.mark.parametrize("with_mask", [False, True])
def test_tiled_fused_logits_loss(with_mask):
    torch.manual_seed(0)
    head = nn.Linear(6, 11, bias=False).double()
    x = torch.randn(2, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 11, (2, 6))
    mask = (torch.arange(12).view(2, 6) % 4 != 0)

    def loss_fn(module, x, y, mask=None):  # a sum over the tile's kept tokens
        losses = torch.nn.functional.cross_entropy(module(x).view(-1, 11), y.view(-1), reduction="none")
        return (losses * mask).sum() if mask is not None else losses.sum()

    given = mask if with_mask else None
    tiled = run(lambda x: TiledFusedLogitsLoss.apply(loss_fn, head, x, y, given, 4, [head.weight], "sum"), head, x)
    assert_same(tiled, run(lambda x: loss_fn(head, x.view(-1, 6), y.view(-1),
                                             None if given is None else given.view(-1)), head, x))


def test_refusals():
    x = torch.zeros(1, 4, 2)
    with pytest.raises(ValueError, match="output_reduction 'max' must be 'mean' or 'sum'"):
        TiledFusedLogitsLoss.apply(None, None, x, x, None, 2, None, "max")
    with pytest.raises(ValueError, match=r"mask \(1, 3\) must be \(batch, sequence\) = \(1, 4\)"):
        TiledFusedLogitsLoss.apply(None, None, x, x, torch.ones(1, 3), 2, None, "sum")
    with pytest.raises(ValueError, match="output_reduction 'max' is not one of"):
        sequence_tiled_compute(None, 4, 2, {"x": x}, {}, "x", output_reduction="max")
