"""Run a function as one checkpointed region: torch's non-reentrant checkpoint, plus the
store (Pa / CPU / Md), selective policies, RNG replay and accounting.

torch.utils.checkpoint (use_reentrant=False) does the recomputation: in forward it keeps
only the region's inputs (saved tensors, so the store's hooks see them) and stands a
placeholder for everything the region would save; the first time backward needs one of
those, it re-runs the region with the forward's CPU and CUDA RNG state (dropout draws the
same masks) and stops as soon as the last needed tensor exists. Selective recomputation
passes torch's selective-checkpoint contexts: operators the policy marks are cached in
forward and served from the cache when the region is re-run.

The function is told apart in its two runs by a call counter: the second call is the
recomputation, marked with `state.recomputation()` so that ZeRO-3 keeps the parameters it
gathers for the backward that follows. Keyword tensors are passed positionally to the
checkpoint so they are saved (and stored) like the others instead of being captured.
"""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from shardwise.runtime.activation.accounting import ActivationTracker, current_tracker, is_parameter
from shardwise.runtime.activation.rng import rng_tracker
from shardwise.runtime.activation.selective import SaveRule
from shardwise.runtime.activation.state import recomputation
from shardwise.runtime.activation.store import CheckpointStore
from shardwise.runtime.base.torch_compat import selective_checkpoint_contexts

NOT_COUNTED = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}


class RegionStats:
    """Totals over every region run with the same options (DeepSpeed's `profile`): wall
    seconds, and the process's CPU seconds (time.process_time: every thread of the process),
    which a machine shared with other jobs disturbs less than wall time."""

    def __init__(self) -> None:
        self.forward_seconds = 0.0
        self.recompute_seconds = 0.0
        self.forward_cpu_seconds = 0.0
        self.recompute_cpu_seconds = 0.0
        self.regions = 0


class _Region:
    """One call: what its recomputation needs to know about its forward."""

    def __init__(self, tracker: ActivationTracker | None, layers: int):
        self.tracker = tracker
        self.layers = layers
        self.ran = False
        self.rng_states: dict[str, torch.Tensor] = {}
        self.cache = _CacheLease(tracker)
        self.counter: _OpCounter | None = None


class _CacheLease:
    """Bytes of the outputs a selective region caches in forward, counted as checkpoints
    until its recomputation takes them over (or the graph is dropped)."""

    def __init__(self, tracker: ActivationTracker | None):
        self.tracker = tracker
        self.nbytes = 0

    def add(self, output: Any) -> None:
        if self.tracker is None:
            return
        nbytes = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(output)
                     if isinstance(t, torch.Tensor))
        self.nbytes += nbytes
        self.tracker.hold_bytes_now("checkpoints", nbytes)

    def release(self) -> None:
        if self.tracker is not None and self.nbytes:
            self.tracker.release_bytes_now("checkpoints", self.nbytes)
        self.nbytes = 0

    def __del__(self) -> None:
        self.release()


class _OpCounter(TorchDispatchMode):
    """Counts the aten operators a recomputation really runs (beneath selective caching)."""

    def __init__(self, tracker: ActivationTracker):
        super().__init__()
        self.tracker = tracker
        self.paused = False  # the machinery's own operators (saving the RNG streams) are not the layer's

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in NOT_COUNTED and not self.paused:
            self.tracker.recomputed_ops += 1
        return func(*args, **(kwargs or {}))


def run_checkpointed(
    function: Callable[..., Any],
    args: tuple,
    kwargs: dict[str, Any],
    store: CheckpointStore,
    *,
    save_rule: SaveRule | None = None,
    layers: int = 1,
    stats: RegionStats | None = None,
    synchronize: bool = False,
) -> Any:
    """`function(*args, **kwargs)`, recomputed in backward instead of kept."""
    tracker = current_tracker()
    region = _Region(tracker, layers)
    names = tuple(name for name, value in kwargs.items() if isinstance(value, torch.Tensor))
    others = {name: value for name, value in kwargs.items() if name not in names}
    count = len(args)

    def body(*flat: Any) -> Any:
        call_kwargs = {**others, **dict(zip(names, flat[count:]))}
        if not region.ran:
            region.ran = True
            region.rng_states = rng_tracker().get_states()
            return function(*flat[:count], **call_kwargs)
        with _recomputing(region, stats, synchronize):
            return function(*flat[:count], **call_kwargs)

    started, started_cpu = time.perf_counter(), time.process_time()
    _synchronize(synchronize)
    with store.saving(tracker):
        output = checkpoint(
            body, *args, *(kwargs[name] for name in names),
            use_reentrant=False, preserve_rng_state=True, context_fn=lambda: _contexts(region, save_rule),
        )
    _synchronize(synchronize)
    if stats is not None:
        stats.forward_seconds += time.perf_counter() - started
        stats.forward_cpu_seconds += time.process_time() - started_cpu
        stats.regions += 1
    return output


def _contexts(region: _Region, save_rule: SaveRule | None) -> tuple[Any, Any]:
    """(forward, recompute) contexts: selective caching, and op counting beneath it."""
    counting = region.tracker is not None and region.tracker.count_ops
    if counting:
        region.counter = _OpCounter(region.tracker)
    if save_rule is None:
        return nullcontext(), (region.counter if counting else nullcontext())

    forward, cached = selective_checkpoint_contexts(save_rule, on_kept=region.cache.add)
    if not counting:
        return forward, cached
    stack = ExitStack()
    return forward, _both(stack, region.counter, cached)


@contextmanager
def _both(stack: ExitStack, first: Any, second: Any) -> Iterator[None]:
    """Enter `first`, then `second` (which therefore handles operators first)."""
    with stack:
        stack.enter_context(first)
        stack.enter_context(second)
        yield


@contextmanager
def _recomputing(region: _Region, stats: RegionStats | None, synchronize: bool) -> Iterator[None]:
    started, started_cpu = time.perf_counter(), time.process_time()
    _synchronize(synchronize)
    region.cache.release()
    tracker = region.tracker
    if tracker is not None:
        tracker.note_recompute(region.layers)
    rng = rng_tracker()
    if region.counter is not None:
        region.counter.paused = True
    outer_states = rng.get_states() if region.rng_states else {}
    if region.counter is not None:
        region.counter.paused = False
    if region.rng_states:
        rng.set_states(region.rng_states)
    try:
        with recomputation(), _count_recomputed(tracker):
            yield
    finally:
        if region.rng_states:
            rng.set_states(outer_states)
        _synchronize(synchronize)
        if stats is not None:
            stats.recompute_seconds += time.perf_counter() - started
            stats.recompute_cpu_seconds += time.process_time() - started_cpu


@contextmanager
def _count_recomputed(tracker: ActivationTracker | None) -> Iterator[None]:
    """Count what the recomputation saves, as "recompute", by wrapping torch's own hook.

    Inside a recomputation torch's checkpoint has pushed the saved-tensor hook that
    collects the re-created tensors; a hook pushed here would replace it, so this one
    calls it and only watches what it keeps. torch offers no public handle on the
    current hooks: `_top_saved_tensors_default_hooks` is the private accessor torch's
    own AOTAutograd uses.
    """
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False) if tracker is not None else None
    if hooks is None:
        yield
        return
    inner_pack, inner_unpack = hooks

    def pack(tensor: torch.Tensor) -> Any:
        # torch's hook keeps a detached tensor as it is, so the object watched here is the
        # one it keeps; watched first, because torch's hook raises to stop the
        # recomputation right after keeping the last tensor backward needs
        held = tensor.detach()
        if not is_parameter(tensor):
            tracker.watch(held, "recompute")
        return inner_pack(held)

    with torch.autograd.graph.saved_tensors_hooks(pack, inner_unpack):
        yield


def _synchronize(enabled: bool) -> None:
    """DeepSpeed's `synchronize_checkpoint_boundary`: wait for the device at region edges."""
    if enabled and torch.cuda.is_available():
        torch.cuda.synchronize()
