"""`runtime.zero.tiling.TiledLinear` / `TiledLinearReturnBias`: nn.Linear's function and
gradients in float64 whatever the tiling, DeepSpeed 0.19.8's constructor arguments and
tile layout, `copy_params_from`, and training under shardwise's ZeRO-3 on 2 ranks equal to
one process training the nn.Linear it tiles."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import shardwise.frontends.deepspeed.api as deepspeed
from shardwise.frontends.deepspeed.api.runtime.utils import partition_uniform
from shardwise.frontends.deepspeed.api.runtime.zero.partition_parameters import GatheredParameters
from shardwise.frontends.deepspeed.api.runtime.zero.tiling import TiledLinear, TiledLinearReturnBias
from shardwise.tools.testing import run_distributed
from tests.frontends.deepspeed.deepspeed_side import deepspeed_json


def _linear(in_features: int, out_features: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias, dtype=torch.float64)


@pytest.mark.parametrize("in_splits, out_splits, bias", [(1, 1, True), (3, 2, True), (7, 5, False), (2, 4, True)])
def test_outputs_and_gradients_are_the_linears(in_splits, out_splits, bias):
    linear = _linear(7, 5, bias)
    tiled = TiledLinear(7, 5, bias=bias, in_splits=in_splits, out_splits=out_splits, init_linear=linear,
                        dtype=torch.float64)
    x = torch.randn(3, 2, 7, dtype=torch.float64)
    x_tiled = x.clone().requires_grad_()
    x.requires_grad_()
    grad_out = torch.randn(3, 2, 5, dtype=torch.float64)
    linear(x).backward(grad_out)
    out = tiled(x_tiled)
    out.backward(grad_out)
    torch.testing.assert_close(out, linear(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x_tiled.grad, x.grad, rtol=1e-12, atol=1e-12)
    for row, (top, bottom) in enumerate(zip(tiled.out_parts, tiled.out_parts[1:])):
        for col, (left, right) in enumerate(zip(tiled.in_parts, tiled.in_parts[1:])):
            tile = tiled.linears[row][col]
            torch.testing.assert_close(tile.weight.grad, linear.weight.grad[top:bottom, left:right], rtol=1e-12,
                                       atol=1e-12)
            assert (tile.bias is not None) == (bias and col == in_splits - 1)  # one bias per output tile
            if tile.bias is not None:
                torch.testing.assert_close(tile.bias.grad, linear.bias.grad[top:bottom], rtol=1e-12, atol=1e-12)


def test_deepspeeds_layout_and_arguments():
    tiled = TiledLinear(10, 7, in_splits=3, out_splits=2, dtype=torch.float64)
    assert (tiled.in_parts, tiled.out_parts) == ([0, 4, 7, 10], [0, 4, 7])  # DeepSpeed's partition_uniform
    assert [[tuple(tile.weight.shape) for tile in row] for row in tiled.linears] == [[(4, 4), (4, 3), (4, 3)],
                                                                                    [(3, 4), (3, 3), (3, 3)]]
    assert sum(p.numel() for p in tiled.parameters()) == 10 * 7 + 7
    for features in range(1, 12):  # the tiles' cuts are deepspeed.runtime.utils.partition_uniform's
        for splits in range(1, features + 1):
            tiled_once = TiledLinear(features, 1, bias=False, in_splits=splits)
            assert tiled_once.in_parts == partition_uniform(features, splits)
    linear = _linear(10, 7, True)
    tiled.copy_params_from(linear)
    x = torch.randn(2, 10, dtype=torch.float64)
    pieces = TiledLinear(10, 7, in_splits=3, out_splits=2, input_is_already_split=True, combine_out_splits=False,
                         init_linear=linear, dtype=torch.float64)(list(torch.split(x, [4, 3, 3], dim=-1)))
    assert [tuple(piece.shape) for piece in pieces] == [(2, 4), (2, 3)]
    torch.testing.assert_close(torch.cat(pieces, dim=-1), linear(x), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="last dimension is 9"):
        tiled(torch.randn(2, 9, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="in_splits=11"):
        TiledLinear(10, 7, in_splits=11)
    with pytest.raises(RuntimeError, match="out_splits=0"):
        TiledLinear(10, 7, out_splits=0)
    with pytest.raises(ValueError, match=r"weight of shape \(7, 10\)"):
        tiled.copy_params_from(nn.Linear(7, 10))
    with pytest.raises(ValueError, match="has bias"):
        tiled.copy_params_from(nn.Linear(10, 7, bias=False))


class ReturnsBias(nn.Linear):
    """Megatron's `skip_bias_add`: the bias returned beside the output, not added."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return nn.functional.linear(x, self.weight), self.bias


def test_return_bias_sums_outputs_and_joins_biases():
    linear = _linear(6, 4, True)
    tiled = TiledLinearReturnBias(6, 4, in_splits=2, out_splits=2, linear_cls=ReturnsBias, init_linear=linear,
                                  dtype=torch.float64)
    x = torch.randn(3, 6, dtype=torch.float64)
    output, bias = tiled(x)
    torch.testing.assert_close(output, x @ linear.weight.T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bias, linear.bias, rtol=0, atol=0)
    output, bias = TiledLinearReturnBias(6, 4, bias=False, in_splits=2, linear_cls=ReturnsBias)(x.float())
    assert bias is None and output.shape == (3, 4)


STEPS, LR = 3, 0.1


def _tiled_model(linear: nn.Linear) -> nn.Sequential:
    return nn.Sequential(TiledLinear(6, 5, in_splits=2, out_splits=3, init_linear=linear), nn.Tanh())


def _train_tiled_at_zero3(rank: int, world_size: int, inputs: torch.Tensor) -> list[torch.Tensor]:
    model = _tiled_model(nn.Linear(6, 5))  # each rank's own values: copy_params_from replaces them
    config = {"train_micro_batch_size_per_gpu": inputs.shape[0] // world_size,
              "optimizer": {"type": "SGD", "params": {"lr": LR}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    tiled = engine.module[0]
    torch.manual_seed(rank + 1)  # rank 1's values differ: rank 0's must win (modifier_rank=0)
    tiled.copy_params_from(_linear(6, 5, True, seed=0).float() if rank == 0 else nn.Linear(6, 5))
    mine = inputs.chunk(world_size)[rank]
    for _ in range(STEPS):
        loss = engine(mine).square().mean()
        engine.backward(loss)
        engine.step()
    with GatheredParameters(list(tiled.parameters())):
        weight = torch.cat([torch.cat([tile.weight for tile in row], dim=1) for row in tiled.linears])
        bias = torch.cat([row[-1].bias for row in tiled.linears])
        return [weight.detach().clone(), bias.detach().clone()]


def test_tiled_linear_trains_at_zero3_as_one_process_trains_the_linear():
    torch.manual_seed(1)
    inputs = torch.randn(4, 6)
    reference = nn.Sequential(_linear(6, 5, True, seed=0).float(), nn.Tanh())
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.stack([reference(half).square().mean() for half in inputs.chunk(2)]).mean().backward()
        optimizer.step()
    for weight, bias in run_distributed(_train_tiled_at_zero3, 2, inputs):
        torch.testing.assert_close(weight, reference[0].weight.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(bias, reference[0].bias.detach(), rtol=1e-5, atol=1e-6)


DEEPSPEED_TILES = """
import json, sys, torch
from deepspeed.runtime.zero.tiling import TiledLinear
answers = []
for in_features, out_features, in_splits, out_splits, bias in json.loads(sys.argv[1]):
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=bias, dtype=torch.float64)
    tiled = TiledLinear(in_features, out_features, bias=bias, in_splits=in_splits, out_splits=out_splits,
                        init_linear=linear, dtype=torch.float64)
    x = torch.linspace(-1, 1, 2 * in_features, dtype=torch.float64).reshape(2, in_features)
    answers.append({"in_parts": tiled.in_parts, "out_parts": tiled.out_parts, "output": tiled(x).tolist(),
                    "biases": [[tile.bias is not None for tile in row] for row in tiled.linears]})
print(json.dumps(answers))
"""
SHAPES = [(10, 7, 3, 2, True), (7, 5, 7, 5, False), (9, 4, 4, 3, True)]


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DEEPSPEED_PYTHON"), reason="set DEEPSPEED_PYTHON to an interpreter with "
                    "DeepSpeed 0.19.8 to compare with it")
def test_deepspeeds_tiles_are_the_same():
    for theirs, (in_features, out_features, in_splits, out_splits, bias) in zip(
            deepspeed_json(DEEPSPEED_TILES, json.dumps(SHAPES), timeout=600), SHAPES, strict=True):
        tiled = TiledLinear(in_features, out_features, bias=bias, in_splits=in_splits, out_splits=out_splits,
                            init_linear=_linear(in_features, out_features, bias), dtype=torch.float64)
        x = torch.linspace(-1, 1, 2 * in_features, dtype=torch.float64).reshape(2, in_features)
        assert (tiled.in_parts, tiled.out_parts) == (theirs["in_parts"], theirs["out_parts"])
        assert [[tile.bias is not None for tile in row] for row in tiled.linears] == theirs["biases"]
        torch.testing.assert_close(tiled(x), torch.tensor(theirs["output"], dtype=torch.float64), rtol=1e-12,
                                   atol=1e-12)
