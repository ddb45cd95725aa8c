"""Where Adafactor's row and column statistics of a matrix live, for whole matrices and
for the pieces ZeRO cuts them into.

A parameter of shape (..., M, L) with B = prod(...) is factored over its last two
dimensions: R = B·M row statistics (one per row of L elements) and C = B·L column
statistics (one per column of each of the B matrices, column c = b·L + l).

Statistics are stored without repetition across ranks: a rank keeps the row statistic of
every row whose *first element* it holds, and the column statistic of every column whose
element in the matrix's *first row* it holds. Both sets are contiguous ranges, so a
piece's state is two short fp32 vectors, and summed over the shard group the state is
exactly R + C values per matrix. Each step rebuilds the full vectors with one sum: every
rank contributes its stored values (zeros elsewhere), which is exact.

The same rule gives the checkpoint form: a row statistic is written at the position of
its row's first element, a column statistic at its column's first-row element, zeros
elsewhere, so after resharding each rank finds its own statistics in its own elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardwise.runtime.optim.layout import PaddedRows


@dataclass(frozen=True)
class Factoring:
    """A parameter factored over its last two dimensions."""

    batches: int  # B
    height: int  # M, rows per matrix
    width: int  # L, elements per row

    @classmethod
    def of(cls, shape: tuple[int, ...]) -> "Factoring | None":
        if len(shape) < 2:
            return None
        return cls(math.prod(shape[:-2]), shape[-2], shape[-1])

    @property
    def rows(self) -> int:
        return self.batches * self.height

    @property
    def columns(self) -> int:
        return self.batches * self.width

    def rows_starting_before(self, position: int) -> int:
        """Rows whose first element lies in [0, position)."""
        return -(-position // self.width)

    def first_row_elements_before(self, position: int) -> int:
        """Elements of the matrices' first rows in [0, position): the column index of the
        next such element."""
        matrix = self.height * self.width
        return (position // matrix) * self.width + min(position % matrix, self.width)

    def stored_rows(self, start: int, stop: int) -> slice:
        return slice(self.rows_starting_before(start), self.rows_starting_before(stop))

    def stored_columns(self, start: int, stop: int) -> slice:
        return slice(self.first_row_elements_before(start), self.first_row_elements_before(stop))

    def row_start_positions(self, start: int, stop: int) -> torch.Tensor:
        """Positions in the piece [start, stop) of its stored rows' first elements."""
        rows = self.stored_rows(start, stop)
        return torch.arange(rows.start, rows.stop) * self.width - start

    def first_row_positions(self, start: int, stop: int) -> torch.Tensor:
        """Positions in the piece of its stored columns' first-row elements."""
        columns = torch.arange(*self.stored_columns(start, stop).indices(self.columns))
        return (columns // self.width) * (self.height * self.width) + columns % self.width - start

    # -- squared sums of a piece's rows and columns -------------------------------------------
    def row_squares(self, rows: torch.Tensor) -> torch.Tensor:
        """Per padded row (rows: (n, L), zeros outside the piece): the sum of squares,
        computed as torch.optim.Adafactor does (norm, squared) so a whole matrix matches."""
        return torch.linalg.vector_norm(rows, dim=1).square_()

    def column_squares(self, rows: torch.Tensor, padded: PaddedRows) -> tuple[int, torch.Tensor]:
        """Per matrix the piece touches and column: the sum of squares over the piece's
        rows. Returns (first matrix, (matrices, L)). A partial matrix at either end is
        reduced on its own, whole matrices in the middle in one go."""
        first_row, count = padded.first_row, padded.rows
        first_matrix = first_row // self.height
        parts = []
        row = first_row
        while row < first_row + count:
            matrix_end = (row // self.height + 1) * self.height
            if row % self.height == 0 and first_row + count >= matrix_end:
                whole = (first_row + count - row) // self.height
                block = rows[row - first_row : row - first_row + whole * self.height]
                parts.append(torch.linalg.vector_norm(block.view(whole, self.height, self.width), dim=1))
                row += whole * self.height
            else:
                end = min(matrix_end, first_row + count)
                parts.append(torch.linalg.vector_norm(rows[row - first_row : end - first_row], dim=0).unsqueeze(0))
                row = end
        return first_matrix, torch.cat(parts).square_()

    def variance(self, row_var: torch.Tensor, col_var: torch.Tensor, padded: PaddedRows, eps1: float) -> torch.Tensor:
        """The factored second moment at the piece's padded rows: row · column / mean of
        the matrix's rows (clamped at eps1), as torch.optim.Adafactor estimates it."""
        rows = torch.arange(padded.first_row, padded.first_row + padded.rows, device=row_var.device)
        matrices = rows // self.height
        row_means = row_var.view(self.batches, self.height).mean(dim=1).clamp_(min=eps1)
        columns = col_var.view(self.batches, self.width).index_select(0, matrices)
        estimate = row_var.index_select(0, rows).unsqueeze(1) * columns
        return estimate.div_(row_means.index_select(0, matrices).unsqueeze(1))
