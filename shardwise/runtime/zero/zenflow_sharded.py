"""ZenFlow at ZeRO stage 3: each rank updates the selected elements of its own shard.

DeepSpeed 0.19.8 (runtime/zenflow/engine_stage3.py, ops/adam/zenflow_torch_adam.py's
ZenFlowSelectiveAdamW_stage3) stores every 2-D weight transposed, so a weight of shape
(rows, columns) is partitioned by itself as `columns` runs of `rows` elements, rank r
holding elements [r * p, (r + 1) * p) with p = ceil(rows * columns / N). Then:

- only a column lying whole inside one rank's partition is ever scored or selected (a
  column cut by a partition boundary is skipped), and top-k takes
  max(1, int(eligible columns * topk_ratio)) of them;
- a 2-D weight with one row (a run of one element per column) is updated whole, as a 1-D
  parameter is;
- the selective AdamW updates the selected elements of the rank's own partition of the
  16-bit parameters (its `ds_tensor`), with this rank's part of the reduced gradient:
  no selected gradient crosses ranks, and its moments cover only this rank's elements.

shardwise lays stage 3 out by module (several parameters per flat unit), so the
eligibility above is computed from DeepSpeed's per-parameter partition, and the update
runs on the elements of this rank's chunk of each unit whose column is selected. Updated
shards are published as after a step (persistent units, whole on every rank, are
all-gathered; DeepSpeed leaves those stale until its next CPU update, which shardwise
does not copy).
"""

from __future__ import annotations

import torch

from shardwise.runtime.accounting import MemoryLedger, tensor_bytes
from shardwise.runtime.zero.shard_store import ShardStore
from shardwise.runtime.zero.strategy import ParameterStrategy


def whole_columns(rows: int, columns: int, partitions: int) -> torch.Tensor:
    """Which columns of a (rows, columns) weight lie whole inside one rank's partition of
    its transposed elements (DeepSpeed's `update_selected_channels`), as a mask."""
    size = -(-rows * columns // partitions)
    index = torch.arange(columns)
    return index * rows // size == ((index + 1) * rows - 1) // size


class ShardedSelection:
    """The selected elements of this rank's chunks and their selective AdamW state."""

    def __init__(self, *, store: ShardStore, params: ParameterStrategy, ledger: MemoryLedger,
                 device: torch.device):
        self.store = store
        self.params = params
        self.ledger = ledger
        self.device = device
        self.positions: list[torch.Tensor] = []  # per unit: selected positions inside this rank's chunk
        # per unit: runs (param group, start, stop) of its selected positions
        self.runs: list[list[tuple[int, int, int]]] = []
        self.exp_avg: list[torch.Tensor] = []
        self.exp_avg_sq: list[torch.Tensor] = []
        self.steps = 0
        self.held = 0

    def plan(self, columns_of: dict[int, torch.Tensor | None]) -> None:
        """Positions of the selected elements in each chunk; `columns_of[id(slot)]`: the
        slot's selected columns, None for a parameter updated whole."""
        self.positions, self.runs = [], []
        for unit in self.store.units:
            found = [torch.zeros(0, dtype=torch.long)]
            runs: list[tuple[int, int, int]] = []
            count = 0
            for piece in unit.owned_pieces(self.store.chunk):
                flat = torch.arange(piece.start, piece.stop)
                columns = columns_of[id(piece.slot)]
                if columns is not None:
                    chosen = torch.zeros(piece.slot.shape[1], dtype=torch.bool)
                    chosen[columns.cpu()] = True
                    flat = flat[chosen[flat % piece.slot.shape[1]]]
                found.append(flat - piece.start + piece.chunk_offset)
                if runs and runs[-1][0] == piece.slot.group:
                    runs[-1] = (piece.slot.group, runs[-1][1], count + len(flat))
                else:
                    runs.append((piece.slot.group, count, count + len(flat)))
                count += len(flat)
            self.positions.append(torch.cat(found))
            self.runs.append(runs)

    def reset_moments(self) -> None:
        """A selection: zeroed moments for the new positions (the step count is kept)."""
        self.exp_avg = [torch.zeros(len(p), dtype=torch.float32, device=self.device) for p in self.positions]
        self.exp_avg_sq = [torch.zeros_like(moment) for moment in self.exp_avg]
        self.ledger.release("optimizer_states", self.held)
        self.held = 2 * sum(tensor_bytes(moment) for moment in self.exp_avg)
        self.ledger.hold("optimizer_states", self.held)

    def gradients(self, grad_scale: float) -> list[torch.Tensor]:
        """This rank's selected gradient elements, on the device."""
        grads = []
        for positions, grad in zip(self.positions, self.store.gradients()):
            selected = grad[positions].float()
            self.store.moved["host_to_device"] += tensor_bytes(selected)
            selected = selected.to(self.device)
            if grad_scale != 1.0:
                selected.mul_(grad_scale)
            grads.append(selected)
        return grads

    def values(self) -> list[torch.Tensor]:
        return [self.params.owned_chunk(unit)[positions].clone()
                for unit, positions in zip(self.store.units, self.positions)]

    def write(self, values: list[torch.Tensor]) -> None:
        for unit, positions, value in zip(self.store.units, self.positions, values):
            chunk = self.params.owned_chunk(unit)
            chunk[positions] = value.to(chunk)

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], param_groups: list[dict]) -> None:
        """AdamW on the selected elements (torch's rule, as DeepSpeed's selective AdamW),
        each run with its parameter group's settings, then the changed shards published."""
        self.steps += 1
        values = []
        for grad, exp_avg, exp_avg_sq, value, runs in zip(grads, self.exp_avg, self.exp_avg_sq, self.values(),
                                                          self.runs):
            value = value.to(self.device, torch.float32)
            for group, start, stop in runs:
                settings = param_groups[group]
                lr, decay, eps, (beta1, beta2) = (settings["lr"], settings["weight_decay"], settings["eps"],
                                                  settings["betas"])
                part, g = value[start:stop], grad[start:stop]
                m1, m2 = exp_avg[start:stop], exp_avg_sq[start:stop]
                part.mul_(1 - lr * decay)
                m1.lerp_(g, 1 - beta1)
                m2.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (m2.sqrt() / (1 - beta2 ** self.steps) ** 0.5).add_(eps)
                part.addcdiv_(m1, denom, value=-lr / (1 - beta1 ** self.steps))
            values.append(value)
        self.write(values)
        self.params.after_update()

    def settle_masters(self) -> None:
        """The device's selected values become the fp32 masters (a checkpoint saves those)."""
        for unit, positions in zip(self.store.units, self.positions):
            master = self.store.master_chunk(unit)
            master[positions.to(master.device)] = self.params.owned_chunk(unit)[positions].to(master)
