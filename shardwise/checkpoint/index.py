"""Where every element of every saved parameter lives, across all rank files.

A loader asks for "elements [a, b) of parameter X's value (or of its exp_avg)" and gets
them from whichever saved pieces overlap that range, whatever world size and stage wrote
them. Only the requested bytes are read, so a rank's reads add up to what it now owns.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from shardwise.checkpoint.format import CheckpointError, piece_key, rank_tensors
from shardwise.checkpoint.safetensors_io import SafetensorsReader


@dataclass(frozen=True)
class SavedPiece:
    name: str
    start: int
    stop: int
    file: str
    tensors: tuple[str, ...]  # "value" and the per-element optimizer states stored for it


class PieceIndex:
    def __init__(self, directory: Path, rank_records: list[dict[str, Any]]):
        self.directory = directory
        self.pieces: dict[str, list[SavedPiece]] = defaultdict(list)
        for rank, record in enumerate(rank_records):
            for piece in record["pieces"]:
                self.pieces[piece["name"]].append(
                    SavedPiece(piece["name"], piece["start"], piece["stop"], rank_tensors(rank),
                               tuple(piece["tensors"]))
                )
        for pieces in self.pieces.values():
            pieces.sort(key=lambda piece: piece.start)
        self._readers: dict[str, SafetensorsReader] = {}

    def check_complete(self, name: str, numel: int) -> None:
        """The saved pieces of `name` tile [0, numel) exactly."""
        position = 0
        for piece in self.pieces.get(name, []):
            if piece.start != position:
                break
            position = piece.stop
        if position != numel:
            raise CheckpointError(
                f"checkpoint {self.directory} does not hold all {numel} elements of {name}: "
                f"the saved pieces cover [0, {position}) contiguously"
            )

    def overlaps(self, name: str, start: int, stop: int) -> Iterator[tuple[SavedPiece, int, int]]:
        for piece in self.pieces.get(name, []):
            low, high = max(start, piece.start), min(stop, piece.stop)
            if low < high:
                yield piece, low, high

    def read_into(self, name: str, tensor: str, start: int, out: torch.Tensor) -> None:
        """Fill flat `out` with elements [start, start + out.numel()) of `tensor` of `name`,
        cast to `out`'s dtype and device; pieces without `tensor` leave `out` untouched."""
        for piece, low, high in self.overlaps(name, start, start + out.numel()):
            if tensor not in piece.tensors:
                continue
            reader = self._reader(piece.file)
            key = piece_key(piece.name, piece.start, piece.stop, tensor)
            target = out[low - start : high - start]
            if target.device.type == "cpu" and target.dtype == reader.entry(key).dtype:
                reader.read_into(key, low - piece.start, target)
            else:
                target.copy_(reader.read(key, low - piece.start, high - piece.start))

    def read(self, name: str, tensor: str, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(stop - start, dtype=dtype)
        self.read_into(name, tensor, start, out)
        return out

    def _reader(self, file: str) -> SafetensorsReader:
        if file not in self._readers:
            self._readers[file] = SafetensorsReader(self.directory / file)
        return self._readers[file]

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def __enter__(self) -> "PieceIndex":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
