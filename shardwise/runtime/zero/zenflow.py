"""ZenFlow (Lan et al., 2025): offloaded training that does not wait for the CPU every step.

ZeRO-Offload's step waits for the CPU optimizer to update every parameter. ZenFlow notices
that a few input columns of each weight carry most of the gradient: those (the top
`topk_ratio` of columns by the sum of |gradient| over the column, and every 1-D
parameter) are updated on the device every step by a small AdamW whose state covers only
them, while the whole gradient accumulates on the host and the CPU optimizer applies the
sum once every `update_interval` steps. The rule, as DeepSpeed 0.19.8 runs it with
`overlap_step` off (runtime/zenflow/, ops/adam/zenflow_*; micro-step m counted from 0):

- the loss is divided by `update_interval` (DeepSpeed makes it the accumulation count);
- from m = `full_warm_up_rounds` on, at a selection step (that one, then every
  `select_interval` steps) the fp32 masters are taken from the device parameters, the
  selective AdamW's moments are zeroed (its step count is kept), and the columns are
  chosen from this step's reduced gradient;
- every step from then on, the selected columns' gradient updates them on the device;
- at an update step (every step during warm-up, then every `update_interval` steps and at
  every `select_interval`), the CPU AdamW steps on the accumulated gradient with its step
  number set to m + 1, the parameters become the new masters, and the selected columns get
  back their device values before this step's selective update is applied to them.

With `overlap_step` the CPU update runs in the background and lands one update later
(runtime/zero/zenflow_overlap.py).

`update_interval` "auto" is the schedule DeepSpeed 0.19.8 actually runs (run it: the
engine's boundary reads `zenflow_need_update[state ^ 1]`, which the optimizer's
`backward_prologue` of the same step has just cleared, so the adaptive flag never decides
an update): the CPU updates at every step m with m + 1 <= `full_warm_up_rounds` and at
every selection boundary ((m + 1) % `select_interval` == 0), never otherwise. DeepSpeed
divides the loss by its accumulation count, which "auto" sets to 0 (every gradient
becomes inf and the weights NaN); shardwise divides by 1, which is DeepSpeed's run with
`engine.backward(loss, scale_wrt_gas=False)`.

At stages 1-2 the whole parameters are on every rank, so every rank runs the same
selective update: the column sums are all-reduced (each rank adds its chunk's part), and
the selected gradients are summed from the chunks that hold them (each element comes
from one rank). The host keeps its own window sum, so the reducer's per-step partition
stays one step's gradient. At stage 3 each rank updates the selected elements of its own
shard, and only columns whole inside one rank's partition (as DeepSpeed partitions each
weight) can be selected (runtime/zero/zenflow_sharded.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from shardwise.runtime.accounting import MemoryLedger, tensor_bytes
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.zero.layout import FlatUnit, ParamSlot
from shardwise.runtime.zero.policy import ZenFlowPolicy
from shardwise.runtime.zero.replicated_params import ReplicatedParameters
from shardwise.runtime.zero.sharded_optimizer import ShardedOptimizer
from shardwise.runtime.zero.strategy import ParameterStrategy
from shardwise.runtime.zero.zenflow_overlap import OverlappedCpuStep
from shardwise.runtime.zero.zenflow_sharded import ShardedSelection, whole_columns


@dataclass(frozen=True)
class ZenFlowSchedule:
    """When ZenFlow selects columns and when the CPU optimizer updates (DeepSpeed's
    `is_zenflow_select_boundary` and `is_zenflow_update_boundary`), by micro-step m."""

    update_interval: int | None  # None: "auto" (the CPU updates at warm-up and selections only)
    select_interval: int  # steps; 0: select once, when warm-up ends
    warm_up: int

    def selective(self, m: int) -> bool:
        """The device updates the selected columns at step m."""
        return m >= self.warm_up

    def selects(self, m: int) -> bool:
        if m < self.warm_up:
            return False
        return m == self.warm_up or (self.select_interval != 0 and m % self.select_interval == 0)

    def updates(self, m: int) -> bool:
        at_selection = self.select_interval != 0 and (m + 1) % self.select_interval == 0
        if self.update_interval is None:
            return m + 1 <= self.warm_up or at_selection
        if m + 1 < self.warm_up:
            return True
        return (m + 1 - self.warm_up) % self.update_interval == 0 or at_selection


@dataclass
class _Selected:
    """One trained parameter's selection and its selective AdamW state (device, fp32)."""

    slot: ParamSlot
    unit: FlatUnit
    is_matrix: bool  # its columns are selected; otherwise it is updated whole
    columns: torch.Tensor | None = None  # sorted column indices (2-D); None: the whole parameter
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    steps: int = 0

    def values(self) -> torch.Tensor:
        """The parameter's selected part as a copy (2-D: its columns; 1-D: all of it)."""
        data = self.slot.param.data
        return data[:, self.columns].clone() if self.is_matrix else data.clone()

    def write(self, values: torch.Tensor) -> None:
        data = self.slot.param.data
        if self.is_matrix:
            data[:, self.columns] = values.to(data.dtype)
        else:
            data.copy_(values)


def selected_count(columns: int, topk_ratio: float) -> int:
    """Columns kept of `columns` (DeepSpeed's `_num_selected_columns`)."""
    return 0 if columns == 0 else max(1, int(columns * topk_ratio))


class ZenFlow:
    """Runs ZenFlow's step in place of the sharded optimizer's (engine.step)."""

    def __init__(self, policy: ZenFlowPolicy, *, optimizer: ShardedOptimizer, params: ParameterStrategy,
                 shard: Communicator, ledger: MemoryLedger, device: torch.device):
        torch_optimizer = optimizer.optimizer
        if not isinstance(torch_optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise ValueError(f"ZenFlow updates with AdamW (DeepSpeed: the CPU Adam and a selective AdamW); the "
                             f"optimizer is {type(torch_optimizer).__name__}: use optimizer type Adam or AdamW")
        self.policy = policy
        self.schedule = ZenFlowSchedule(None if policy.update_interval == "auto" else policy.update_interval,
                                        policy.select_interval_steps, policy.full_warm_up_rounds)
        self.optimizer = optimizer
        self.store = optimizer.store
        self.params = params
        self.shard = shard
        self.ledger = ledger
        self.device = device
        # stage 3 (the parameters partitioned): each rank updates its own shard's selected elements
        self.sharded = (None if isinstance(params, ReplicatedParameters)
                        else ShardedSelection(store=self.store, params=params, ledger=ledger, device=device))
        self.selected: list[_Selected] = []
        for unit in self.store.units:
            for slot in unit.slots:
                if len(slot.shape) > 2:
                    raise ValueError(f"ZenFlow selects columns of 2-D weights and updates 1-D parameters whole; "
                                     f"{slot.name} has shape {tuple(slot.shape)}: reshape it or train without "
                                     "zenflow")
                # stage 3 stores a weight transposed: one row is one element per column, updated whole
                is_matrix = len(slot.shape) == 2 and (self.sharded is None or slot.shape[0] > 1)
                if is_matrix and self.sharded is not None and not whole_columns(*slot.shape, shard.size).any():
                    raise ValueError(f"ZenFlow at stage 3 selects columns that lie whole inside one rank's partition "
                                     f"(as DeepSpeed partitions each transposed weight); no column of {slot.name} "
                                     f"{tuple(slot.shape)} does over {shard.size} ranks: use fewer ranks, or train "
                                     "it without zenflow")
                self.selected.append(_Selected(slot, unit, is_matrix))
        # the host's window sum, laid out as the store's gradient partition
        self.window = [torch.zeros_like(grad, dtype=torch.float32) for grad in self.store.gradients()]
        ledger.hold("grads", sum(tensor_bytes(window) for window in self.window), tier="host")
        self.overlap = (OverlappedCpuStep(optimizer=optimizer, params=params, shard=shard, ledger=ledger,
                                          device=device, windows=self.window) if policy.overlap_step else None)
        self.first_update_after_warm_up = True  # overlap_step: it has no earlier step to wait for


    def close(self) -> None:
        """Stop the background CPU step of `overlap_step` (engine.destroy)."""
        if self.overlap is not None:
            self.overlap.close()

    def learn_epoch_length(self, steps_per_epoch: int) -> None:
        """The training data's batches per epoch (DeepSpeed reads `len(training_dataloader)`):
        an epoch-based selection interval becomes a number of steps."""
        epochs = self.policy.select_interval_epochs
        if not epochs:
            return
        interval = epochs * steps_per_epoch
        if self.schedule.update_interval is not None and interval < self.schedule.update_interval:
            raise ValueError(f"zenflow select interval ({epochs} epoch(s) of {steps_per_epoch} steps) is shorter than "
                             f"update_interval {self.policy.update_interval}: select by steps, or update more often")
        self.schedule = replace(self.schedule, select_interval=interval)

    # -- checkpoints (runtime/checkpoint/zenflow_state.py) -------------------------------------
    def settle_masters(self) -> None:
        """Write the device's selected values into the fp32 masters. Between selections the
        masters of selected columns (and 1-D parameters) are stale: training never reads
        them (the device values are restored after every CPU update, and a selection takes
        the masters from the device), but a checkpoint saves the masters as the weights."""
        if self.overlap is not None:
            raise ValueError("saving a checkpoint with zenflow.overlap_step true is not supported: the fp32 masters "
                             "run one CPU update ahead of the device's weights, and the two sets of CPU Adam moments "
                             "(DeepSpeed 0.19.8 keeps them inside its optimizer process, out of its checkpoints) "
                             "are not saved; train with overlap_step false to checkpoint")
        if self.sharded is not None:
            self.sharded.settle_masters()
            return
        entries = {id(entry.slot): entry for entry in self.selected if entry.columns is not None or
                   (not entry.is_matrix and entry.exp_avg is not None)}
        for unit in self.store.units:
            master = self.store.master_chunk(unit)
            for piece in unit.owned_pieces(self.store.chunk):
                entry = entries.get(id(piece.slot))
                if entry is None:
                    continue
                values = piece.slot.param.data.reshape(-1)[piece.start : piece.stop].float()
                target = master[piece.chunk_offset : piece.chunk_offset + piece.numel]
                if not entry.is_matrix:
                    target.copy_(values)
                    continue
                columns = piece.slot.shape[1]
                chosen = torch.zeros(columns, dtype=torch.bool)
                chosen[entry.columns.cpu()] = True
                keep = chosen[torch.arange(piece.start, piece.stop) % columns]
                target[keep] = values.to(target.device)[keep]

    def state_record(self) -> dict:
        """What a checkpoint keeps besides the tensors of `state_tensors`."""
        record = {"columns": {e.slot.name: None if e.columns is None else e.columns.tolist() for e in self.selected},
                  "steps": {e.slot.name: e.steps for e in self.selected},
                  "window_sizes": [window.numel() for window in self.window]}
        if self.sharded is not None:
            record["shard_steps"] = self.sharded.steps
            record["shard_selected"] = [len(positions) for positions in self.sharded.positions]
        return record

    def state_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {f"window.{index}": window for index, window in enumerate(self.window)}
        if self.sharded is not None:
            for index, (exp_avg, exp_avg_sq) in enumerate(zip(self.sharded.exp_avg, self.sharded.exp_avg_sq)):
                tensors[f"exp_avg.shard.{index}"] = exp_avg
                tensors[f"exp_avg_sq.shard.{index}"] = exp_avg_sq
            return tensors
        for entry in self.selected:
            if entry.exp_avg is not None:
                tensors[f"exp_avg.{entry.slot.name}"] = entry.exp_avg.reshape(-1)
                tensors[f"exp_avg_sq.{entry.slot.name}"] = entry.exp_avg_sq.reshape(-1)
        return tensors

    def load_state(self, record: dict, read: Callable[[str, torch.Tensor], None], same_layout: bool) -> None:
        """Restore what `state_record` / `state_tensors` saved; `read(key, out)` fills a tensor.
        The window sum is laid out by this rank's partition: at another world size it can
        only be resumed empty (a checkpoint taken right after a CPU update)."""
        if self.overlap is not None:
            raise ValueError("loading a checkpoint with zenflow.overlap_step true is not supported: its two sets of "
                             "CPU Adam moments cannot be rebuilt from a checkpoint's one; resume with overlap_step "
                             "false")
        if self.sharded is not None:
            self._load_sharded_state(record, read, same_layout)
            return
        if "shard_steps" in record:
            raise ValueError("this ZenFlow checkpoint was saved at ZeRO stage 3: its selective moments and the host's "
                             "gradient sum cover the saving rank's shard; resume at stage 3 and the saving world size")
        for entry in self.selected:
            columns = record["columns"].get(entry.slot.name)
            entry.columns = None if columns is None else torch.tensor(columns, dtype=torch.long, device=self.device)
            entry.steps = record["steps"].get(entry.slot.name, 0)
            key = f"exp_avg.{entry.slot.name}"
            if columns is None and (entry.is_matrix or entry.steps == 0):
                continue
            shape = (entry.slot.shape[0], len(columns)) if entry.is_matrix else tuple(entry.slot.shape)
            if entry.exp_avg is None:
                entry.exp_avg = torch.zeros(shape, dtype=torch.float32, device=self.device)
                entry.exp_avg_sq = torch.zeros_like(entry.exp_avg)
                self.ledger.hold("optimizer_states", 2 * tensor_bytes(entry.exp_avg))
            read(key, entry.exp_avg.view(-1))
            read(f"exp_avg_sq.{entry.slot.name}", entry.exp_avg_sq.view(-1))
        if all(entry.columns is not None for entry in self.selected if entry.is_matrix):
            self._plan_gathers()
        if same_layout and record["window_sizes"] == [window.numel() for window in self.window]:
            for index, window in enumerate(self.window):
                read(f"window.{index}", window)
            return
        for index, size in enumerate(record["window_sizes"]):
            saved = torch.zeros(size)
            read(f"window.{index}", saved)
            if saved.any():
                raise ValueError("this checkpoint was saved in the middle of a ZenFlow update window, at another "
                                 "world size: the host's gradient sum cannot be laid out again; resume at the saving "
                                 "world size, or save right after a CPU update (every update_interval steps)")
        for window in self.window:
            window.zero_()

    def _load_sharded_state(self, record: dict, read: Callable[[str, torch.Tensor], None], same_layout: bool) -> None:
        """Stage 3: the moments and the window sum cover this rank's shard, so they resume at
        the saving world size only."""
        if "shard_steps" not in record or not same_layout or record["window_sizes"] != [w.numel() for w in self.window]:
            raise ValueError("this ZenFlow checkpoint cannot be resumed here: at ZeRO stage 3 the selective moments "
                             "and the host's gradient sum cover the saving rank's shard (and a stage 1-2 checkpoint "
                             "keeps them whole); resume at the saving stage and world size")
        for entry in self.selected:
            columns = record["columns"].get(entry.slot.name)
            entry.columns = None if columns is None else torch.tensor(columns, dtype=torch.long, device=self.device)
            entry.steps = record["steps"].get(entry.slot.name, 0)
        self.sharded.steps = record["shard_steps"]
        if record["shard_selected"]:
            self.sharded.plan({id(e.slot): e.columns for e in self.selected})
            self.sharded.reset_moments()
            for index, (exp_avg, exp_avg_sq) in enumerate(zip(self.sharded.exp_avg, self.sharded.exp_avg_sq)):
                read(f"exp_avg.shard.{index}", exp_avg)
                read(f"exp_avg_sq.shard.{index}", exp_avg_sq)
        for index, window in enumerate(self.window):
            read(f"window.{index}", window)

    @property
    def update_interval(self) -> int:
        """What the loss is divided by (DeepSpeed sets its accumulation count to this; for
        "auto", 1: see the module's docstring)."""
        return self.schedule.update_interval or 1

    # -- one step ----------------------------------------------------------------------------
    def step(self, m: int, *, grad_scale: float, max_norm: float) -> None:
        """Micro-step `m`: the store's partition holds this step's reduced gradient
        (times 1 / `grad_scale`)."""
        schedule = self.schedule
        if schedule.selects(m):
            if m != 0:
                if self.overlap is not None:
                    self.overlap.keep_before_refresh()
                for unit in self.store.units:
                    self.store.refresh_master(unit)
            self._select()
        selective = schedule.selective(m)
        if self.sharded is not None:
            self._sharded_step(m, selective, grad_scale=grad_scale, max_norm=max_norm)
            return
        grads = self._selected_gradients(grad_scale) if selective else None
        for window, grad in zip(self.window, self.store.gradients()):
            window.add_(grad)
        if not schedule.updates(m):
            self._selective_step(grads)
            return
        kept = [entry.values() for entry in self.selected] if selective else None
        if self.overlap is None:
            self._cpu_step(m, grad_scale=grad_scale, max_norm=max_norm)
        else:
            self._overlapped_cpu_step(m, grad_scale=grad_scale, max_norm=max_norm)
        if selective:
            for entry, values in zip(self.selected, kept):
                entry.write(values)
            self._selective_step(grads)

    def _sharded_step(self, m: int, selective: bool, *, grad_scale: float, max_norm: float) -> None:
        """Stage 3's step, in the order of the whole-parameter one."""
        grads = self.sharded.gradients(grad_scale) if selective else None
        for window, grad in zip(self.window, self.store.gradients()):
            window.add_(grad)
        groups = self.optimizer.optimizer.param_groups
        if not self.schedule.updates(m):
            if selective:
                self.sharded.step(grads, groups)
            return
        kept = self.sharded.values() if selective else None
        if self.overlap is None:
            self._cpu_step(m, grad_scale=grad_scale, max_norm=max_norm)
        else:
            self._overlapped_cpu_step(m, grad_scale=grad_scale, max_norm=max_norm)
        if selective:
            self.sharded.write(kept)
            self.sharded.step(grads, groups)

    def _overlapped_cpu_step(self, m: int, *, grad_scale: float, max_norm: float) -> None:
        """DeepSpeed's order (ZenFlowZeroOptimizerParallel.step): during warm-up submit and
        wait; after it, first land the previous step's result, then submit this one."""
        overlap, warm_up = self.overlap, self.schedule.warm_up
        if m < warm_up:
            state = m & 1
        elif self.schedule.update_interval is None:
            state = (m + 1) & 1  # DeepSpeed's zenflow_state, toggled every backward from 0
        else:
            state = (m // self.schedule.update_interval) & 1
        if m < warm_up:
            overlap.submit(m, state, self.window, grad_scale=grad_scale, max_norm=max_norm)
        if overlap.started:
            if m + 1 > warm_up and self.first_update_after_warm_up:
                self.first_update_after_warm_up = False
            else:
                overlap.land()
        if m >= warm_up:
            overlap.submit(m, state, self.window, grad_scale=grad_scale, max_norm=max_norm)

    def _select(self) -> None:
        """Top columns by the sum of |gradient| over each column, the same on every rank."""
        matrices = [entry for entry in self.selected if entry.is_matrix]
        sizes = [entry.slot.shape[1] for entry in matrices]
        scores = torch.zeros(sum(sizes), dtype=torch.float32)
        by_slot = dict(zip((id(entry.slot) for entry in matrices), torch.split(scores, sizes)))
        for unit, grad in zip(self.store.units, self.store.gradients()):
            for piece in unit.owned_pieces(self.store.chunk):
                if id(piece.slot) not in by_slot:
                    continue
                columns = piece.slot.shape[1]
                flat = torch.arange(piece.start, piece.stop)
                part = grad[piece.chunk_offset : piece.chunk_offset + piece.numel].float().abs()
                by_slot[id(piece.slot)].index_add_(0, flat % columns, part)
        scores = scores.to(self.device)
        self.shard.all_reduce(scores, "zenflow column scores").wait()
        chosen = []
        for entry, score in zip(matrices, torch.split(scores, sizes)):
            eligible = torch.ones(score.numel(), dtype=torch.bool)
            if self.sharded is not None:
                eligible = whole_columns(*entry.slot.shape, self.shard.size)
                score = score.masked_fill(~eligible.to(score.device), -torch.inf)
            count = selected_count(int(eligible.sum()), self.policy.topk_ratio)
            chosen.append(torch.topk(score, count).indices.sort().values)
        if chosen:
            indices = torch.cat(chosen)
            self.shard.broadcast(indices, 0, "zenflow selected columns")  # one choice, whatever the rounding
            chosen = torch.split(indices, [len(c) for c in chosen])
        for entry, columns in zip(matrices, chosen):
            entry.columns = columns
        if self.sharded is not None:
            self.sharded.plan({id(e.slot): e.columns for e in self.selected})
            self.sharded.reset_moments()
            return
        self._plan_gathers()
        for entry in self.selected:
            shape = (entry.slot.shape[0], len(entry.columns)) if entry.is_matrix else tuple(entry.slot.shape)
            if entry.exp_avg is None:
                entry.exp_avg = torch.zeros(shape, dtype=torch.float32, device=self.device)
                entry.exp_avg_sq = torch.zeros_like(entry.exp_avg)
                self.ledger.hold("optimizer_states", 2 * tensor_bytes(entry.exp_avg))
            else:
                entry.exp_avg.zero_()
                entry.exp_avg_sq.zero_()

    def _plan_gathers(self) -> None:
        """For the current selection: which elements of each unit's gradient chunk go where
        in the flat buffer of selected gradients (made once per selection, used every step)."""
        self.shapes = [(e.slot.shape[0], len(e.columns)) if e.is_matrix else tuple(e.slot.shape) for e in self.selected]
        self.sizes = [torch.Size(shape).numel() for shape in self.shapes]
        offsets = dict(zip((id(e.slot) for e in self.selected),
                           torch.tensor([0, *self.sizes[:-1]]).cumsum(0).tolist()))
        entries = {id(e.slot): e for e in self.selected}
        self.gathers: list[tuple[torch.Tensor, torch.Tensor]] = []  # per unit: (from the chunk, into the flat buffer)
        for unit in self.store.units:
            sources, targets = [], []
            for piece in unit.owned_pieces(self.store.chunk):
                entry = entries[id(piece.slot)]
                flat_index = torch.arange(piece.start, piece.stop)
                if entry.is_matrix:
                    columns = piece.slot.shape[1]
                    position = torch.full((columns,), -1, dtype=torch.long)
                    position[entry.columns.cpu()] = torch.arange(len(entry.columns))
                    where = position[flat_index % columns]
                    kept = where >= 0
                    target = (flat_index[kept] // columns) * len(entry.columns) + where[kept]
                    source = (flat_index - piece.start + piece.chunk_offset)[kept]
                else:
                    target, source = flat_index, flat_index - piece.start + piece.chunk_offset
                sources.append(source)
                targets.append(target + offsets[id(piece.slot)])
            self.gathers.append((torch.cat(sources), torch.cat(targets)))
        self.owned_selected = sum(len(source) for source, _ in self.gathers)

    def _selected_gradients(self, grad_scale: float) -> list[torch.Tensor]:
        """Each parameter's selected gradient, whole on every rank: each rank fills the
        elements its chunk holds and the sum over the shard group completes them."""
        flat = torch.zeros(sum(self.sizes), dtype=torch.float32)
        for (source, target), grad in zip(self.gathers, self.store.gradients()):
            flat[target] = grad[source].float()
        self.store.moved["host_to_device"] += self.owned_selected * flat.element_size()
        flat = flat.to(self.device)
        self.shard.all_reduce(flat, "zenflow selected gradients").wait()
        if grad_scale != 1.0:
            flat.mul_(grad_scale)
        return [view.view(shape) for view, shape in zip(torch.split(flat, self.sizes), self.shapes)]

    @torch.no_grad()
    def _selective_step(self, grads: list[torch.Tensor] | None) -> None:
        """AdamW on the selected part of every parameter, on the device (torch's rule, as
        DeepSpeed's ZenFlowSelectiveAdamW)."""
        if grads is None:
            return
        groups = self.optimizer.optimizer.param_groups
        for entry, grad in zip(self.selected, grads):
            group = groups[entry.slot.group]
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            entry.steps += 1
            value = entry.values().float()
            value.mul_(1 - lr * decay)
            entry.exp_avg.lerp_(grad, 1 - beta1)
            entry.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            correction1 = 1 - beta1 ** entry.steps
            correction2 = 1 - beta2 ** entry.steps
            denom = (entry.exp_avg_sq.sqrt() / correction2 ** 0.5).add_(eps)
            value.addcdiv_(entry.exp_avg, denom, value=-lr / correction1)
            entry.write(value)

    def _cpu_step(self, m: int, *, grad_scale: float, max_norm: float) -> None:
        """The CPU optimizer on the window's sum, as step number m + 1 (DeepSpeed passes
        `step_id = micro_step + 1` to its CPU Adam), then the parameters from the masters."""
        for window, grad in zip(self.window, self.store.gradients()):
            grad.copy_(window)
            window.zero_()
        if max_norm > 0:
            norm_squared = self.optimizer.local_grad_norm_squared().to(self.device)
            self.shard.all_reduce(norm_squared, "zenflow window gradient norm").wait()
            norm = float(norm_squared.sqrt()) * grad_scale
            grad_scale *= min(1.0, max_norm / (norm + 1e-6))
        torch_optimizer = self.optimizer.optimizer
        for group in torch_optimizer.param_groups:
            for master in group["params"]:
                state = torch_optimizer.state[master]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
                state["step"].fill_(m)
        self.optimizer.step(grad_scale=grad_scale)
        self.params.after_update()
