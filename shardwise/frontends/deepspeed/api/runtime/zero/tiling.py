"""`deepspeed.runtime.zero.tiling`: `TiledLinear`, a linear layer cut into a grid of
smaller linear layers, and `TiledLinearReturnBias` for Megatron-style layers that return
their bias beside the output.

Why tiles: under ZeRO-3 a layer's parameters are gathered whole for its forward, so one
huge linear layer needs its whole weight on the device at once. Cut into
`out_splits` x `in_splits` tiles, each its own module, only one tile's weight needs to be
whole at a time. Tile (o, i) maps input columns `in_parts[i]:in_parts[i + 1]` to output
columns `out_parts[o]:out_parts[o + 1]` (DeepSpeed 0.19.8's `partition_uniform` cuts, the
larger pieces first); an output tile sums its row of tiles in input order, and only the
last tile of each row has a bias, so the layer computes nn.Linear's function with the same
parameters laid out in pieces. Under shardwise's ZeRO-3 each tile is a module of its own,
partitioned like any other (runtime/zero/layout.py groups a module's parameters into units).

Subclasses change how the pieces meet through the three methods DeepSpeed's subclasses
override: `_split_global_input`, `_reduce_local_output` and `_combine_output_splits`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from shardwise.frontends.deepspeed.api.runtime.zero.partition_parameters import GatheredParameters

__all__ = ["TiledLinear", "TiledLinearReturnBias", "split_tensor_along_last_dim"]


def split_tensor_along_last_dim(tensor: torch.Tensor, partitions: Sequence[int] | int,
                                contiguous_split_chunks: bool = False) -> tuple[torch.Tensor, ...]:
    """`tensor` cut along its last dimension into pieces of the sizes `partitions` lists (or
    of that one size); views unless `contiguous_split_chunks` asks for contiguous copies."""
    pieces = torch.split(tensor, partitions, dim=-1)
    return tuple(piece.contiguous() for piece in pieces) if contiguous_split_chunks else pieces


def _even_boundaries(num_items: int, num_parts: int) -> list[int]:
    """`num_parts + 1` boundaries cutting `num_items` (at least `num_parts`) into pieces
    whose sizes differ by at most one, the larger first: runtime/utils.py's
    `partition_uniform` for that case (this package may not import the runtime package,
    which imports it)."""
    size, extra = divmod(num_items, num_parts)
    return [part * size + min(part, extra) for part in range(num_parts + 1)]


class TiledLinear(nn.Module):
    """A drop-in for `nn.Linear(in_features, out_features, bias)` made of
    `out_splits` x `in_splits` tiles built by `linear_cls(in, out, bias=..., **kwargs)`
    (module docstring). With `input_is_already_split` the forward takes the input as the
    list of its `in_splits` column pieces; with `combine_out_splits=False` it returns the
    list of the `out_splits` output pieces instead of their concatenation. `init_linear`
    (a linear layer of the whole shape) gives the tiles its values (`copy_params_from`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls: type[nn.Module] = nn.Linear, init_linear: nn.Module | None = None, **kwargs: Any):
        super().__init__()
        if not 1 <= in_splits <= in_features:
            raise RuntimeError(f"TiledLinear(in_splits={in_splits}): the input is cut into 1 to in_features "
                               f"({in_features}) tiles")
        if not 1 <= out_splits <= out_features:
            raise RuntimeError(f"TiledLinear(out_splits={out_splits}): the output is cut into 1 to out_features "
                               f"({out_features}) tiles")
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bias
        self.in_splits = in_splits
        self.out_splits = out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = _even_boundaries(in_features, in_splits)  # boundaries: tile i is in_parts[i]:in_parts[i + 1]
        self.out_parts = _even_boundaries(out_features, out_splits)
        self.linears = nn.ModuleList(
            nn.ModuleList(linear_cls(self.in_parts[col + 1] - self.in_parts[col],
                                     self.out_parts[row + 1] - self.out_parts[row],
                                     bias=bias and col == in_splits - 1, **kwargs)
                          for col in range(in_splits))
            for row in range(out_splits))
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: torch.Tensor | Sequence[torch.Tensor]) -> Any:
        if self.in_splits == 1:
            inputs = [input_]
        elif self.input_is_already_split:
            if len(input_) != self.in_splits:
                raise ValueError(f"TiledLinear(input_is_already_split=True) takes its input as {self.in_splits} "
                                 f"pieces (in_splits), got {len(input_)}")
            inputs = input_
        else:
            if input_.shape[-1] != self.in_features:
                raise ValueError(f"TiledLinear({self.in_features}, {self.out_features}): the input's last dimension "
                                 f"is {input_.shape[-1]}, not in_features")
            inputs = self._split_global_input(input_, [end - start for start, end in zip(self.in_parts,
                                                                                         self.in_parts[1:])])
        outputs = []
        for row in self.linears:
            output = None
            for col, (tile, piece) in enumerate(zip(row, inputs)):
                output = self._reduce_local_output(in_id=col, out_id=len(outputs), current_out=output,
                                                   new_out=tile(piece))
            outputs.append(output)
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _split_global_input(self, input: torch.Tensor, split_sizes: list[int]) -> Sequence[Any]:  # noqa: A002
        """The input's column pieces, one per input tile (DeepSpeed's override point)."""
        return split_tensor_along_last_dim(input, split_sizes)

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        """An output tile's sum so far plus tile (out_id, in_id)'s output. The first is
        copied: a tile's output may be a view, which autograd would not let a later
        in-place sum write through."""
        return new_out.clone() if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        """The output tiles joined into the whole output."""
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Give the tiles the values of `other`, a linear layer of the whole shape (with a
        bias exactly when this layer has one). Under ZeRO-3 each tile is gathered and
        rank 0's values are kept on every rank (`GatheredParameters(modifier_rank=0)`),
        so every rank must call it."""
        weight = getattr(other, "weight", None)
        if weight is None or tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"TiledLinear.copy_params_from: needs a weight of shape ({self.out_features}, "
                             f"{self.in_features}), got {None if weight is None else tuple(weight.shape)}")
        other_bias = getattr(other, "bias", None)
        if self.use_bias != (other_bias is not None):
            raise ValueError(f"TiledLinear.copy_params_from: this layer {'has' if self.use_bias else 'has no'} bias "
                             f"but the one copied from {'has none' if other_bias is None else 'has one'}")
        if other_bias is not None and tuple(other_bias.shape) != (self.out_features,):
            raise ValueError(f"TiledLinear.copy_params_from: needs a bias of shape ({self.out_features},), got "
                             f"{tuple(other_bias.shape)}")
        for row, (top, bottom) in enumerate(zip(self.out_parts, self.out_parts[1:])):
            for col, (left, right) in enumerate(zip(self.in_parts, self.in_parts[1:])):
                tile = self.linears[row][col]
                with GatheredParameters(tile.weight, modifier_rank=0):
                    tile.weight.copy_(weight[top:bottom, left:right])
                if tile.bias is not None:
                    with GatheredParameters(tile.bias, modifier_rank=0):
                        tile.bias.copy_(other_bias[top:bottom])


class TiledLinearReturnBias(TiledLinear):
    """`TiledLinear` over tiles that return `(output, bias)` (Megatron-LM's linear layers
    with `skip_bias_add`): the outputs are summed and joined as in `TiledLinear`, and the
    biases (one per output tile, from the tiles that have one) joined, or None if no tile
    returns one."""

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        if not (isinstance(new_out, tuple) and len(new_out) == 2 and new_out[0] is not None):
            raise TypeError(f"TiledLinearReturnBias: tile ({out_id}, {in_id}) must return (output, bias), "
                            f"got {type(new_out).__name__}")
        summed, kept_bias = (None, None) if current_out is None else current_out
        output, bias = new_out
        summed = super()._reduce_local_output(in_id=in_id, out_id=out_id, current_out=summed, new_out=output)
        return summed, (kept_bias if bias is None else bias)

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        output = super()._combine_output_splits([summed for summed, _ in outputs])
        biases = [bias for _, bias in outputs if bias is not None]
        return output, (super()._combine_output_splits(biases) if biases else None)
