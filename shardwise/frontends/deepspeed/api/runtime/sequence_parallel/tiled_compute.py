"""ALST's tiled computations (`deepspeed.runtime.sequence_parallel.ulysses_sp`'s
`TiledMLP`, `sequence_tiled_compute` / `SequenceTiledCompute`, `TiledFusedLogitsLoss`):
autograd functions that run a token-wise computation over tiles of the sequence, so that
its intermediate activations (an MLP's 4x-wide hidden layer, the logits over the whole
vocabulary) exist for one tile at a time instead of the whole sequence.

Each keeps only its input: forward runs the tiles without autograd, and backward runs
each tile again with autograd and back-propagates it at once (so the function's compute
is that of activation checkpointing). The results and gradients are those of the untiled
computation, up to the order of floating-point sums.

`compute_params`: the weights the computation uses. DeepSpeed marks them
`ds_grad_is_ready = False` while tiles remain, so its ZeRO reduces their gradient once,
after the last tile; they are marked the same way here, for code that reads the flag.
shardwise's ZeRO needs no mark: its gradient hooks accumulate every tile's contribution
into the parameter's unit and reduce the unit once all of its parameters reported, which
happens after the last tile as long as the unit holds some parameter used after the tiled
computation in backward (an MLP inside a decoder layer: the layer's attention and norms;
a Hugging Face output layer: the embedding in the same unit). The ALST loop with a tiled
Llama MLP and loss equals whole sequences at ZeRO 1-3 (tests/frontends/deepspeed/api/
runtime/sequence_parallel/test_ulysses_sp.py).

`TiledFusedLogitsLoss` differs from DeepSpeed's on purpose: DeepSpeed back-propagates the
tiles inside forward with an assumed upstream gradient of 1 and only rescales the input's
gradient in backward, so its weights' gradients miss any factor applied to the loss after
it (gradient accumulation's 1/steps, fp16 loss scaling, ALST's token weighting across
ranks; measured with DeepSpeed 0.19.8: a third of the true gradient for the loss times 3).
Here the tiles are back-propagated in backward with the real upstream gradient; the price
is a second forward per tile.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
from torch import nn

REDUCTIONS = (None, "mean", "sum")


def _mark_ready(params: list[torch.Tensor], ready: bool) -> None:
    for param in params:
        param.ds_grad_is_ready = ready


def _trainable(params: Iterable[torch.Tensor] | None) -> list[torch.Tensor]:
    return [param for param in params or () if param.requires_grad]


class TiledMLP(torch.autograd.Function):
    """`TiledMLP.apply(fn, module, x, shards, compute_params)`: `fn(module, x)` (a
    token-wise function: an MLP) over `shards` tiles of `x`'s tokens (dimension -2 and
    those before it), outputs concatenated."""

    @staticmethod
    def forward(ctx, fn: Callable[[nn.Module, torch.Tensor], torch.Tensor], module: nn.Module, x: torch.Tensor,
                shards: int, compute_params: Iterable[torch.Tensor] | None) -> torch.Tensor:
        ctx.fn, ctx.module, ctx.shards = fn, module, shards
        ctx.compute_params = _trainable(compute_params)
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(module, tile) for tile in torch.chunk(x, shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        tokens = x.detach().reshape(-1, x.shape[-1])  # tiles over every token, whatever the batch
        grads = grad.reshape(-1, grad.shape[-1])
        x_grad = torch.zeros_like(tokens) if x.requires_grad else None
        tiles = list(zip(torch.chunk(tokens, ctx.shards), torch.chunk(grads, ctx.shards)))
        start = 0
        for index, (tile, tile_grad) in enumerate(tiles):
            _mark_ready(ctx.compute_params, index == len(tiles) - 1)
            leaf = tile.detach().requires_grad_(x.requires_grad)
            with torch.enable_grad():
                output = ctx.fn(ctx.module, leaf)
            torch.autograd.backward(output, tile_grad)
            if x_grad is not None:
                x_grad[start:start + tile.shape[0]] = leaf.grad
            start += tile.shape[0]
        return None, None, None if x_grad is None else x_grad.view(x.shape), None, None


def sequence_tiled_compute(fn: Callable[..., torch.Tensor], seqlen: int, shards: int,
                           kwargs_to_shard: dict[str, torch.Tensor], kwargs_to_pass: dict[str, Any],
                           grad_requiring_tensor_key: str, compute_params: Iterable[torch.Tensor] | None = None,
                           output_unshard_dimension: int = 1, output_reduction: str | None = "mean") -> torch.Tensor:
    """`fn(**kwargs_to_shard tiles, **kwargs_to_pass)` over `shards` tiles of the sequence
    (dimension 1 of every tensor of `kwargs_to_shard`, tiles of ceil(seqlen / shards)),
    the outputs concatenated along `output_unshard_dimension` (0: each tile's output is
    one element, a loss), then reduced by `output_reduction` (None, "mean" or "sum").
    Only `kwargs_to_shard[grad_requiring_tensor_key]` gets a gradient (and the weights fn uses)."""
    keys_to_shard, keys_to_pass = list(kwargs_to_shard), list(kwargs_to_pass)
    return SequenceTiledCompute.apply(fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key,
                                      compute_params, output_unshard_dimension, output_reduction,
                                      *kwargs_to_shard.values(), *kwargs_to_pass.values())


class SequenceTiledCompute(torch.autograd.Function):
    """The autograd function of `sequence_tiled_compute` (DeepSpeed's positional order)."""

    @staticmethod
    def forward(ctx, fn: Callable[..., torch.Tensor], seqlen: int, shards: int, keys_to_shard: list[str],
                keys_to_pass: list[str], grad_requiring_tensor_key: str,
                compute_params: Iterable[torch.Tensor] | None, output_unshard_dimension: int,
                output_reduction: str | None, *args: Any) -> torch.Tensor:
        if output_reduction not in REDUCTIONS:
            raise ValueError(f"sequence_tiled_compute: output_reduction {output_reduction!r} is not one of "
                             f"{REDUCTIONS}")
        if grad_requiring_tensor_key not in keys_to_shard:
            raise ValueError(f"sequence_tiled_compute: grad_requiring_tensor_key {grad_requiring_tensor_key!r} is "
                             f"not among kwargs_to_shard's keys {keys_to_shard}")
        ctx.fn, ctx.reduction, ctx.dimension = fn, output_reduction, output_unshard_dimension
        ctx.compute_params = _trainable(compute_params)
        ctx.keys_to_shard, ctx.key = keys_to_shard, grad_requiring_tensor_key
        ctx.sharded = dict(zip(keys_to_shard, args[:len(keys_to_shard)]))
        ctx.passed = dict(zip(keys_to_pass, args[len(keys_to_shard):]))
        ctx.arguments = len(args)
        step = math.ceil(seqlen / shards)
        ctx.bounds = [(start, min(start + step, seqlen)) for start in range(0, seqlen, step)]
        with torch.no_grad():
            outputs = [fn(**SequenceTiledCompute._tile(ctx.sharded, start, end), **ctx.passed)
                       for start, end in ctx.bounds]
        ctx.sizes = [1 if output_unshard_dimension == 0 else output.shape[output_unshard_dimension]
                     for output in outputs]
        whole = (torch.stack(outputs) if output_unshard_dimension == 0
                 else torch.cat(outputs, dim=output_unshard_dimension))
        ctx.numel = whole.numel()
        if output_reduction == "mean":
            return whole.mean()
        return whole.sum() if output_reduction == "sum" else whole

    @staticmethod
    def _tile(tensors: dict[str, torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
        return {key: value[:, start:end] for key, value in tensors.items()}

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[Any, ...]:
        wanted = ctx.sharded[ctx.key]
        wanted_grad = torch.zeros_like(wanted) if wanted.requires_grad else None
        offset = 0
        for index, (start, end) in enumerate(ctx.bounds):
            _mark_ready(ctx.compute_params, index == len(ctx.bounds) - 1)
            tiles = SequenceTiledCompute._tile(ctx.sharded, start, end)
            leaf = tiles[ctx.key].detach().requires_grad_(wanted.requires_grad)
            tiles[ctx.key] = leaf
            with torch.enable_grad():
                output = ctx.fn(**tiles, **ctx.passed)
            torch.autograd.backward(output, SequenceTiledCompute._tile_grad(ctx, grad, output, index, offset))
            if wanted_grad is not None:
                wanted_grad[:, start:end] = leaf.grad
            offset += ctx.sizes[index]
        positions = [None] * ctx.arguments
        positions[ctx.keys_to_shard.index(ctx.key)] = wanted_grad
        return (None,) * 9 + tuple(positions)

    @staticmethod
    def _tile_grad(ctx, grad: torch.Tensor, output: torch.Tensor, index: int, offset: int) -> torch.Tensor:
        """The gradient of this tile's output: of the reduced scalar, spread over its elements."""
        if ctx.reduction == "mean":
            return (grad / ctx.numel).expand_as(output)
        if ctx.reduction == "sum":
            return grad.expand_as(output)
        if ctx.dimension == 0:
            return grad[index]
        return grad.narrow(ctx.dimension, offset, ctx.sizes[index])


class TiledFusedLogitsLoss(torch.autograd.Function):
    """`TiledFusedLogitsLoss.apply(fn, module, x, y, mask, shards, compute_params,
    output_reduction)`: `fn(module, x_tile, y_tile[, mask_tile])` (a loss: the logits of
    the tile and their cross-entropy) over `shards` tiles of the tokens of `x` (batch,
    sequence, ...) and `y` (batch, sequence, ...), and of `mask` (batch, sequence) when not
    None; the tiles' losses averaged ("mean") or summed ("sum"). Only `x` gets a gradient
    (and the weights fn uses). See the module docstring for how it differs from DeepSpeed's."""

    @staticmethod
    def forward(ctx, fn: Callable[..., torch.Tensor], module: nn.Module, x: torch.Tensor, y: torch.Tensor,
                mask: torch.Tensor | None, shards: int, compute_params: Iterable[torch.Tensor] | None,
                output_reduction: str) -> torch.Tensor:
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f"TiledFusedLogitsLoss: output_reduction {output_reduction!r} must be 'mean' or 'sum'")
        if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise ValueError(f"TiledFusedLogitsLoss: x {tuple(x.shape)} and y {tuple(y.shape)} must both be (batch, "
                             "sequence, ...) with the same batch and sequence sizes")
        if mask is not None and mask.shape != x.shape[:2]:
            raise ValueError(f"TiledFusedLogitsLoss: mask {tuple(mask.shape)} must be (batch, sequence) = "
                             f"{tuple(x.shape[:2])}")
        ctx.fn, ctx.module, ctx.shards, ctx.reduction = fn, module, shards, output_reduction
        ctx.compute_params = _trainable(compute_params)
        ctx.has_mask = mask is not None
        ctx.save_for_backward(x, y, mask if mask is not None else torch.empty(0))
        with torch.no_grad():
            losses = [fn(module, *tile) for tile in TiledFusedLogitsLoss._tiles(x.detach(), y, mask, shards)]
        whole = torch.stack(losses)
        return whole.mean() if output_reduction == "mean" else whole.sum()

    @staticmethod
    def _tiles(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, shards: int) -> list[tuple]:
        """Tiles of every token (batch and sequence flattened): x's, y's and the mask's."""
        parts = [torch.chunk(x.reshape(-1, *x.shape[2:]), shards), torch.chunk(y.reshape(-1, *y.shape[2:]), shards)]
        if mask is not None:
            parts.append(torch.chunk(mask.reshape(-1), shards))
        return list(zip(*parts))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[Any, ...]:
        x, y, mask = ctx.saved_tensors
        tiles = TiledFusedLogitsLoss._tiles(x.detach(), y, mask if ctx.has_mask else None, ctx.shards)
        tile_grad = grad / len(tiles) if ctx.reduction == "mean" else grad
        x_grad = torch.zeros_like(x).view(-1, *x.shape[2:]) if x.requires_grad else None
        start = 0
        for index, (x_tile, *rest) in enumerate(tiles):
            _mark_ready(ctx.compute_params, index == len(tiles) - 1)
            leaf = x_tile.detach().requires_grad_(x.requires_grad)
            with torch.enable_grad():
                loss = ctx.fn(ctx.module, leaf, *rest)
            torch.autograd.backward(loss, tile_grad)
            if x_grad is not None:
                x_grad[start:start + x_tile.shape[0]] = leaf.grad
            start += x_tile.shape[0]
        return None, None, None if x_grad is None else x_grad.view(x.shape), None, None, None, None, None
