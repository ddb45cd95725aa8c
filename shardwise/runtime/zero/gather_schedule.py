"""When stage-3 parameters are gathered, prefetched and released (C4).

Hooks on every module that owns partitioned parameters drive four events:

    pre-forward    gather the module's units (and prefetch the next ones)
    post-forward   release them, unless they are used again before max_reuse_distance
                   other elements are gathered (0: always release);
                   hook the outputs' gradients so that, in backward,
    pre-backward   the units are gathered again before the module's backward runs
    grads ready    (reported by GradientReducer) the units are freed for good this step;
                   a frozen unit has no gradient: it is freed once the gradients of the
                   module's inputs are done, the last thing backward needs it for

The first step records the sequence of unit uses (forward, then backward) as a *trace*.
Later steps, as long as they follow the trace, prefetch the units ahead of the current
position (up to stage3_prefetch_bucket_size elements, never more than
stage3_max_live_parameters gathered). When a step departs from the trace (data-dependent
control flow), prefetching stops for the rest of that step and units are fetched on
demand, so a changed order costs speed, never correctness; the new order becomes the trace.

Ranks must gather the same units in the same order: collectives pair up by position,
so a rank-dependent branch would otherwise pair one rank's gather of module A with
another's gather of module B (wrong weights, or gloo aborting on the size mismatch).
Whenever a rank fetches off the trace (the first step, or after its order changed), the
ranks first agree on the plan: a 16-byte all-reduce of its checksum on the control
group. A disagreement raises `DivergentExecutionError` on every rank, naming what each
rank was about to gather, before any mismatched gather is sent. At the end of backward
the same check covers the step's whole record of uses and gathers, so all ranks hold the
same trace, and fetches along it are identical on every rank without checking each one.
If one rank leaves the trace while another follows it, the first blocks in its check and
the second in a gather that is never answered: both fail at the collective timeout with
an error naming the module, never hang. Every forward also begins with the same check
(a forward with gradients, or one without): a forward one rank runs alone (an extra
evaluation) would otherwise gather along the trace, pair its gathers with the other
ranks' next forward, and leave every later collective one pass apart until the timeout;
checked, it meets their forward's check or backward's end check and is named at once.

Three departures from "a module's units are its own parameters":
- `register_external`: a module's forward may read parameters of a module whose forward
  never runs (a fused loss reading the output embedding's weight straight from the head);
  those units are then gathered with the reading module's own, for its whole forward, and
  again before its backward, so the gradient computed through them lands on whole units.
- `standing_aside`: inside it, the hooks do nothing at all (no record, gather or rank
  check) and modules compute with units someone already holds whole
  (`gathered_for_generation`). Generation needs this: each rank decodes until its own
  sequences end, so ranks run different numbers of forwards, and any per-forward
  collective would pair one rank's forward with another's next step.
- returned parameters: a forward may return one of its module's parameters (a layer
  handing its bias to its caller, which adds it): the unit holding it then stays gathered
  as a use of the caller, released
  when the caller's forward ends (or passed on again if the caller returns it too), as
  DeepSpeed registers such a parameter as an external parameter of the caller. Only modules
  with hooks count as callers (those owning partitioned parameters, and the root).

Activation recomputation re-runs a checkpointed layer's forward inside backward, and its
modules' hooks fire again. There each unit is gathered again (on demand, or by prefetch
along the trace; counted in `recompute_gathers`) and then kept: not counted as a user, not
released after the module's forward. The layer's backward follows at once and needs the
same units, which are freed when their gradients are complete (or at the end of
backward). So a recomputation adds no gather to the backward's own, and never loses a
unit it still needs (releasing after each recomputed module would free the unit under
the backward that just gathered it).
"""

from __future__ import annotations

import datetime
import math
import zlib
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from shardwise.runtime.activation.state import recomputing
from shardwise.runtime.distributed.collectives import CollectiveError, Communicator, MismatchedCallError
from shardwise.runtime.reliability.errors import DivergentExecutionError
from shardwise.runtime.zero.layout import FlatUnit
from shardwise.runtime.zero.policy import PrefetchPolicy
from shardwise.runtime.zero.sharded_params import ShardedParameters


class GatherSchedule:
    def __init__(
        self,
        root: nn.Module,
        module_units: dict[nn.Module, list[FlatUnit]],
        params: ShardedParameters,
        comm: Communicator,
        *,
        prefetch: PrefetchPolicy,
        frozen: set[int] = frozenset(),
    ):
        """`prefetch`: how far ahead to gather, how much may be gathered at once, and
        within which distance a unit used again stays gathered."""
        self.root = root
        self.module_units = module_units
        self.params = params
        self.comm = comm
        self.prefetch_bucket_size = prefetch.prefetch_bucket_size
        self.max_live_parameters = prefetch.max_live_parameters
        self.max_reuse_distance = prefetch.max_reuse_distance
        self.frozen = frozen  # indices of units without gradients
        self.backward_uses: dict[int, int] = {}  # frozen unit -> forward uses whose backward is pending
        self.units = {unit.index: unit for units in module_units.values() for unit in units}
        self.trace: list[int] = []
        self.next_use_distance: list[float] = []
        self.record: list[int] = []
        self.on_trace = False
        self.gather_log: list[int] = []
        self.prefetched = 0  # units gathered ahead of their use, since start
        self.recompute_gathers = 0  # unit uses by recomputations (each gathered again), since start
        self.backward_use_callbacks: list = []  # called with each trained unit about to run backward
        self.positions: dict[nn.Module, list[list[int]]] = defaultdict(list)
        self.standing_aside_depth = 0  # > 0 inside `standing_aside`
        # hooked modules whose forward is running, outermost first, each with the units it
        # holds for parameters returned to it by the modules it called
        self.running: list[tuple[nn.Module, list[FlatUnit]]] = []
        self.handles = []
        self.hooked: set[nn.Module] = set()
        for module in [*module_units, root]:
            self._hook(module)

    def _hook(self, module: nn.Module) -> None:
        if module in self.hooked:
            return
        self.hooked.add(module)
        self.handles.append(module.register_forward_pre_hook(self._pre_forward))
        self.handles.append(module.register_forward_hook(self._post_forward))

    def register_external(self, module: nn.Module, params: list[nn.Parameter]) -> None:
        """`module`'s forward reads `params` although the modules owning them do not run
        in it: gather their units with `module`'s own. Parameters kept whole (below the
        persistence threshold) need nothing. Call it on every rank, before a forward."""
        unit_of = {id(slot.param): unit for unit in self.units.values() for slot in unit.slots}
        units = self.module_units.get(module, [])
        added = [unit for p in params if (unit := unit_of.get(id(p))) is not None and unit not in units]
        if added:
            self.module_units[module] = units + list({id(unit): unit for unit in added}.values())
            self._hook(module)

    @contextmanager
    def standing_aside(self) -> Iterator[None]:
        """Forwards without gradients that need no hook: every unit they read is held
        whole by the caller, and each rank may run any number of them."""
        self.standing_aside_depth += 1
        try:
            yield
        finally:
            self.standing_aside_depth -= 1

    def _check_standing_aside(self, module: nn.Module) -> None:
        if torch.is_grad_enabled():
            raise RuntimeError(f"{type(module).__name__} ran a forward with gradients while the stage-3 hooks stand "
                               "aside (gathered_for_generation, or DeepSpeed's hooks removed by RLHF code): backward "
                               "would find no gathered units; "
                               "generate under torch.no_grad()")
        missing = [str(unit) for unit in self.module_units.get(module, []) if not self.params.is_available(unit)]
        if missing:
            raise RuntimeError(f"{type(module).__name__} ran while the stage-3 hooks stand aside, but its units "
                               f"{', '.join(missing)} are not gathered: gather every parameter of the model")

    # -- uses, fetches and prefetches ------------------------------------------------------
    def _use(self, units: list[FlatUnit]) -> list[int]:
        """Record a use of `units`, make them available, prefetch along the trace."""
        positions = []
        for unit in units:
            position = len(self.record)
            if self.on_trace and (position >= len(self.trace) or self.trace[position] != unit.index):
                self.on_trace = False
            self.record.append(unit.index)
            positions.append(position)
        plan = [unit for unit in units if not self.params.is_available(unit)]
        if self.on_trace:
            ahead = self._prefetch_plan(len(self.record), plan)
            self.prefetched += len(ahead)
            plan += ahead
        if plan:
            if not self.on_trace:
                names = ", ".join(str(unit) for unit in plan)
                self._agree(str([unit.index for unit in plan]), f"was about to gather {names}")
            for unit in plan:
                self.gather_log.append(unit.index)
                self.params.fetch(unit)
        for unit in units:
            self.params.wait(unit)
        return positions

    def _prefetch_plan(self, start: int, planned: list[FlatUnit]) -> list[FlatUnit]:
        """Units ahead on the trace, within the prefetch and live-parameter limits."""
        ahead, plan = 0, []
        live = self.params.gathered_numel() + sum(unit.padded_numel for unit in planned)
        for index in self.trace[start:]:
            unit = self.units[index]
            ahead += unit.numel
            if ahead > self.prefetch_bucket_size:
                break
            if self.params.is_available(unit) or unit in planned or unit in plan:
                continue
            if live + unit.padded_numel > self.max_live_parameters:
                break
            live += unit.padded_numel
            plan.append(unit)
        return plan

    def _reused_soon(self, position: int) -> bool:
        return (
            self.on_trace
            and position < len(self.next_use_distance)
            and self.next_use_distance[position] < self.max_reuse_distance
            and self.params.gathered_numel() <= self.max_live_parameters
        )

    # -- module hooks -------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        if self.standing_aside_depth:
            self._check_standing_aside(module)
            return
        if recomputing():  # keep what a recomputation gathers: backward uses it next
            units = self.module_units.get(module, [])
            self._use(units)
            self.recompute_gathers += len(units)
            self._free_frozen_after_input_grads(units, args, counted=False)
            return
        if module is self.root:
            self._begin_pass()
            training = torch.is_grad_enabled()
            self._agree(f"forward {training}", f"began a {'training' if training else 'no-grad'} forward")
        units = self.module_units.get(module, [])
        self.positions[module].append(self._use(units))
        for unit in units:
            self.params.users[unit.index] = self.params.users.get(unit.index, 0) + 1
        self.running.append((module, []))

    def _post_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        if self.standing_aside_depth or recomputing():
            return
        units = self.module_units.get(module, [])
        _, carried = self.running.pop() if self.running else (module, [])
        returned = _returned_parameters(output) if self.running else set()
        caller_holds = self.running[-1][1] if self.running else []
        for unit, position in zip(units, self.positions[module].pop()):
            if returned and any(id(slot.param) in returned for slot in unit.slots):
                caller_holds.append(unit)  # the caller uses it next: its use goes on until the caller's ends
            elif self.params.release_use(unit) == 0 and not self._reused_soon(position):
                self.params.free(unit)
        for unit in carried:
            if returned and any(id(slot.param) in returned for slot in unit.slots):
                caller_holds.append(unit)
            elif self.params.release_use(unit) == 0:
                self.params.free(unit)
        if units and torch.is_grad_enabled():
            tensors = _needing_grad(output)
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda grads: self._pre_backward(units), mode="any"
                )
                self._free_frozen_after_input_grads(units, args, counted=True)
        if module is self.root and not torch.is_grad_enabled():
            self._free_unused()  # no backward will follow this forward
            self.params.buffers.end_pass()  # nor an end of backward to give spare memory back
            if not self.trace:  # e.g. an engine without an optimizer: forward-only passes prefetch too
                self.end_backward()

    def _free_frozen_after_input_grads(self, units: list[FlatUnit], args: tuple, counted: bool) -> None:
        """Backward needs a frozen unit only to pass gradients through to the module's
        inputs: free it when those are complete for every use of the step (`counted`:
        a forward use, whose backward is pending until then). A recomputation's own hook
        fires only under reentrant checkpointing, whose first forward ran without
        gradients and so counted no use; otherwise the first forward's hook frees."""
        frozen = [unit for unit in units if unit.index in self.frozen] if self.frozen else []
        if not frozen:  # every training step passes here: no work for modules without frozen units
            return
        inputs = _needing_grad(args)
        if not inputs:
            return
        if counted:
            for unit in frozen:
                self.backward_uses[unit.index] = self.backward_uses.get(unit.index, 0) + 1
        torch.autograd.graph.register_multi_grad_hook(inputs, lambda grads: self._release_frozen(frozen, counted))

    def _release_frozen(self, units: list[FlatUnit], counted: bool) -> None:
        for unit in units:
            pending = self.backward_uses.pop(unit.index, 0) - counted
            if pending > 0:
                self.backward_uses[unit.index] = pending
            elif not self.params.users.get(unit.index):
                self.params.free(unit)

    def _pre_backward(self, units: list[FlatUnit]) -> None:
        self._use(units)
        for unit in units:
            if unit.index in self.frozen:
                continue
            for callback in self.backward_use_callbacks:
                callback(unit)

    def _begin_pass(self) -> None:
        """A new forward starts: forget an unfinished record (e.g. a forward without
        backward, or one that raised) and free what it left gathered."""
        self.abort()
        self.on_trace = bool(self.trace)

    def abort(self) -> None:
        """Forget a pass that did not finish: a module whose forward raised never ran its
        post-forward hook, so its units are still marked in use. Release those uses and
        free every unit nobody else (gathered_parameters) holds, so the next forward
        gathers fresh values instead of silently reusing a stale copy."""
        for module, stack in self.positions.items():
            for _ in stack:
                for unit in self.module_units.get(module, []):
                    self.params.release_use(unit)
        self.positions.clear()
        for _, carried in self.running:
            for unit in carried:
                self.params.release_use(unit)
        self.running.clear()
        self.backward_uses.clear()
        self._free_unused()
        self.record = []
        self.gather_log = []
        self.on_trace = False

    # -- backward --------------------------------------------------------------------------------
    def on_grads_ready(self, unit: FlatUnit) -> None:
        """Reducer callback: the unit's gradients are complete, so backward is done with it."""
        if unit.index in self.units and not self.params.users.get(unit.index):
            self.params.free(unit)

    def end_backward(self) -> None:
        """Free everything, keep the step's order as the trace, check ranks agreed (also
        after the first forward run without gradients, when there is no trace yet)."""
        self._free_unused()
        self.backward_uses.clear()
        if self.record and self.record != self.trace:
            self._set_trace(self.record)
        log, record = self.gather_log, self.record
        self.gather_log, self.record = [], []
        self.on_trace = False
        self._check_ranks_agree(log, record)

    def _free_unused(self) -> None:
        for index in list(self.params.gathered):
            if not self.params.users.get(index):
                self.params.free(self.units[index])

    def _set_trace(self, trace: list[int]) -> None:
        """Store the trace and, per position, the elements used before the same unit recurs."""
        self.trace = list(trace)
        self.next_use_distance = [math.inf] * len(trace)
        last_seen: dict[int, int] = {}
        prefix = [0]
        for index in trace:
            prefix.append(prefix[-1] + self.units[index].numel)
        for position in range(len(trace) - 1, -1, -1):
            index = trace[position]
            if index in last_seen:
                following = last_seen[index]
                self.next_use_distance[position] = prefix[following] - prefix[position + 1]
            last_seen[index] = position

    # -- rank agreement ------------------------------------------------------------------------------
    def _check_ranks_agree(self, log: list[int], record: list[int]) -> None:
        last = f", the last of {self.units[log[-1]]}" if log else ""
        self._agree(f"end {log} {record}", f"finished backward after {len(log)} gathers{last}")

    def agree_on_entering(self, call: str, timeout: datetime.timedelta) -> None:
        """`call` (gathered_parameters) gathers outside forward and backward, so every rank
        must enter it at the same point. Its check meets another rank's forward or
        backward-end check, naming both at once; a rank elsewhere is named after `timeout`."""
        self._agree(f"enter {call}", f"entered {call}", timeout)

    def _agree(self, signature: str, description: str, timeout: datetime.timedelta | None = None) -> None:
        """All ranks must pass the same `signature` here; otherwise raise on every rank."""
        if self.comm.world_size == 1:
            return
        checksum = zlib.crc32(signature.encode())
        both = torch.tensor([checksum, -checksum], dtype=torch.int64)
        try:
            self.comm.control_all_reduce(
                both, f"the stage-3 gather-order check (this rank {description})", op=dist.ReduceOp.MAX,
                timeout=timeout,
            )
        except CollectiveError as error:
            if timeout is None:
                raise
            raise MismatchedCallError(
                f"rank {self.comm.global_rank}: this rank {description}, which is collective at ZeRO stage 3, but "
                f"not every rank of the {self.comm.handle.describe()} did within {timeout.total_seconds():g}s "
                f"({error})"
            ) from error
        if both[0].item() == -both[1].item():
            return
        descriptions = self.comm.control_all_gather_object(description)
        members = self.comm.handle.ranks
        seen = "; ".join(f"rank {members[rank]} {text}" for rank, text in enumerate(descriptions))
        raise DivergentExecutionError(
            f"rank {self.comm.global_rank}: ranks disagree on which parameters to gather ({seen}). "
            "Stage 3 needs every rank to run the same modules in the same order; make the "
            "branch depend on data that is equal on all ranks, or keep the branch's "
            "parameters whole (raise stage3_param_persistence_threshold above their size)."
        )

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.hooked.clear()


def _returned_parameters(output: object) -> set[int]:
    """The ids of the parameters a forward returned: in its containers, or attributes of an
    object it returned (DeepSpeed looks there too)."""
    found = set()
    for leaf in tree_flatten(output)[0]:
        values = [leaf] if torch.is_tensor(leaf) else list(vars(leaf).values()) if hasattr(leaf, "__dict__") else []
        found.update(id(value) for value in values if isinstance(value, nn.Parameter))
    return found


def _needing_grad(value: object) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if torch.is_tensor(t) and t.requires_grad]
