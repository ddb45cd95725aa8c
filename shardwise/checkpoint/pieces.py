"""What a rank owns, named the way a checkpoint stores it: parameter name + element range.

The engine keeps a rank's share as flat chunks of units (layout.py) and the optimizer's
state per segment of a chunk. Neither survives a change of world size, stage or bucket
size; (name, [start, stop) of the flattened parameter) does. Saving walks these ranges
and writes the views they carry; loading walks the new owner's ranges and fills them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.zero.sharded_optimizer import SegmentState


@dataclass(frozen=True)
class OwnedRange:
    """Elements [start, stop) of parameter `name` held by this rank."""

    name: str
    start: int
    stop: int
    master: torch.Tensor  # the fp32 master values of these elements (a view)
    segment: SegmentState  # the optimizer segment they sit in
    segment_offset: int  # where `start` sits inside the segment

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def state_view(self, state: torch.Tensor) -> torch.Tensor:
        """These elements of a per-element optimizer state tensor of the segment."""
        return state[self.segment_offset : self.segment_offset + self.numel]


def owned_ranges(engine: Any) -> list[OwnedRange]:
    """Every trained element this rank owns (stage 0: everything), padding excluded."""
    chunk = 0 if engine.stage == 0 else engine.rank
    segments: dict[int, list[SegmentState]] = defaultdict(list)
    for segment in engine.optimizer.segments:
        segments[segment.unit].append(segment)
    ranges = []
    for position, unit in enumerate(engine.units):
        master = engine.optimizer.master_chunks[position]
        for piece in unit.owned_pieces(chunk):
            segment = next(s for s in segments[unit.index] if s.start <= piece.chunk_offset < s.stop)
            ranges.append(
                OwnedRange(
                    piece.slot.name,
                    piece.start,
                    piece.stop,
                    master[piece.chunk_offset : piece.chunk_offset + piece.numel],
                    segment,
                    piece.chunk_offset - segment.start,
                )
            )
    return ranges


def module_extras(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Frozen parameters and persistent buffers (BatchNorm statistics...): not trained, so
    not partitioned, and whole on every rank. Non-persistent buffers (rotary tables,
    causal masks) are rebuilt by the model and, as in `state_dict()`, not saved."""
    persistent = set(module.state_dict(keep_vars=True))
    extras = [(name, param) for name, param in module.named_parameters() if not param.requires_grad]
    extras += [(name, buffer) for name, buffer in module.named_buffers() if name in persistent]
    return extras


def describe_model(engine: Any) -> dict[str, Any]:
    """Names and shapes the loader checks a model against (stage-3 parameters are empty
    placeholders between forwards, so trained shapes come from the layout)."""
    trained = {slot.name: list(slot.shape) for unit in engine.units for slot in unit.slots}
    module = engine.module
    parameters = [  # dtype: of the stored values (fp32 masters for trained parameters)
        {"name": name, "shape": trained.get(name, list(param.shape)), "trainable": name in trained,
         "dtype": "float32" if name in trained else _dtype_name(param.dtype)}
        for name, param in module.named_parameters()
    ]
    persistent = set(module.state_dict(keep_vars=True))
    buffers = [
        {"name": name, "shape": list(buffer.shape), "dtype": _dtype_name(buffer.dtype)}
        for name, buffer in module.named_buffers()
        if name in persistent
    ]
    canonical = {id(param): name for name, param in module.named_parameters()}
    aliases = {
        name: canonical[id(param)]
        for name, param in module.named_parameters(remove_duplicate=False)
        if canonical[id(param)] != name
    }
    return {"parameters": parameters, "buffers": buffers, "aliases": aliases}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
