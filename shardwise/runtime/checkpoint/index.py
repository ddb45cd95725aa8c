"""Where every element of every saved parameter lives, across all rank files.

A loader asks for "elements [a, b) of parameter X's value (or of its exp_avg)" and gets
them from whichever saved pieces overlap that range, whatever world size and stage wrote
them. Only the requested bytes are read, so a rank's reads add up to what it now owns.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch

from shardwise.runtime.checkpoint.format import CheckpointError, piece_key, rank_tensors
from shardwise.runtime.checkpoint.safetensors_io import SafetensorsReader, TensorEntry


@dataclass(frozen=True)
class SavedPiece:
    """Elements of parameter `name` stored contiguously in `file`. Usually the one range
    [start, stop); a strided piece (a tensor-parallel block split along a later dimension:
    one run per row) holds runs of `run` elements every `stride` elements from `start`,
    up to `stop`, so a block costs one piece, not one per row."""

    name: str
    start: int
    stop: int
    file: str
    tensors: tuple[str, ...]  # "value" and the per-element optimizer states stored for it
    run: int = 0  # 0: one run, [start, stop)
    stride: int = 0

    def runs_between(self, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """(low, high, position in the stored data) of this piece's elements in [start, stop)."""
        if not self.run:
            low, high = max(start, self.start), min(stop, self.stop)
            if low < high:
                yield low, high, low - self.start
            return
        count = (self.stop - self.start - self.run) // self.stride + 1
        first = max(0, (start - self.start) // self.stride)
        last = min(count - 1, (stop - 1 - self.start) // self.stride)
        for k in range(first, last + 1):
            begin = self.start + k * self.stride
            low, high = max(start, begin), min(stop, begin + self.run)
            if low < high:
                yield low, high, k * self.run + low - begin


class PieceReader(Protocol):
    """One rank file's tensors, read by element range (`SafetensorsReader`, or a converter's
    tensors in memory)."""

    def entry(self, name: str) -> TensorEntry: ...

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None: ...

    def read(self, name: str, start: int, stop: int) -> torch.Tensor: ...

    def close(self) -> None: ...


class PieceIndex:
    def __init__(self, directory: Path, rank_records: list[dict[str, Any]],
                 open_reader: Callable[[str], PieceReader] | None = None):
        """`open_reader(file)` opens a rank file's tensors (default: the safetensors file
        `directory / file`); a front end reading another format hands its own."""
        self.directory = directory
        self._open_reader = open_reader or (lambda file: SafetensorsReader(directory / file))
        self.pieces: dict[str, list[SavedPiece]] = defaultdict(list)
        for rank, record in enumerate(rank_records):
            for piece in record["pieces"]:
                self.pieces[piece["name"]].append(
                    SavedPiece(piece["name"], piece["start"], piece["stop"], rank_tensors(rank),
                               tuple(piece["tensors"]), piece.get("run", 0), piece.get("stride", 0))
                )
        for pieces in self.pieces.values():
            pieces.sort(key=lambda piece: piece.start)
        self._readers: dict[str, PieceReader] = {}

    def check_complete(self, name: str, numel: int) -> None:
        """The saved pieces of `name` tile [0, numel) exactly."""
        runs = sorted((low, high) for piece in self.pieces.get(name, [])
                      for low, high, _ in piece.runs_between(piece.start, piece.stop))
        position = 0
        for low, high in runs:
            if low != position:
                break
            position = high
        if position != numel:
            raise CheckpointError(
                f"checkpoint {self.directory} does not hold all {numel} elements of {name}: "
                f"the saved pieces cover [0, {position}) contiguously"
            )

    def overlaps(self, name: str, start: int, stop: int) -> Iterator[tuple[SavedPiece, int, int, int]]:
        """(piece, low, high, position of `low` in the piece's data) for every stored run
        meeting [start, stop)."""
        for piece in self.pieces.get(name, []):
            if piece.start < stop and start < piece.stop:
                for low, high, position in piece.runs_between(start, stop):
                    yield piece, low, high, position

    def read_into(self, name: str, tensor: str, start: int, out: torch.Tensor) -> None:
        """Fill flat `out` with elements [start, start + out.numel()) of `tensor` of `name`,
        cast to `out`'s dtype and device; pieces without `tensor` leave `out` untouched."""
        for piece, low, high, position in self.overlaps(name, start, start + out.numel()):
            if tensor not in piece.tensors:
                continue
            reader = self._reader(piece.file)
            key = piece_key(piece.name, piece.start, piece.stop, tensor)
            target = out[low - start : high - start]
            if target.device.type == "cpu" and target.dtype == reader.entry(key).dtype:
                reader.read_into(key, position, target)
            else:
                target.copy_(reader.read(key, position, position + high - low))

    def read(self, name: str, tensor: str, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(stop - start, dtype=dtype)
        self.read_into(name, tensor, start, out)
        return out

    def _reader(self, file: str) -> PieceReader:
        if file not in self._readers:
            self._readers[file] = self._open_reader(file)
        return self._readers[file]

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def __enter__(self) -> "PieceIndex":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
