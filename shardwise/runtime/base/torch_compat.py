"""Every torch API that moved between the oldest supported torch (2.9) and the newest.

shardwise supports torch 2.9 through 2.15. Where an API was renamed or changed inside that
range, it is detected here, once, by looking for the API itself rather than comparing
version strings (a nightly or a vendor build carries the API of its code, not of its
number), and the rest of the package imports the name from here.

Moved APIs, the release they moved in, and the fallback before it:

    torch.distributed.all_gather_single      2.13: renamed from all_gather_into_tensor
                                             (same arguments; the old name stays as an
                                             alias, deprecated in 2.13 and 2.14).
                                             Fallback: all_gather_into_tensor.
    torch.distributed.reduce_scatter_single  2.13: renamed from reduce_scatter_tensor, as
                                             above. Fallback: reduce_scatter_tensor.
    SelectiveCheckpointContext.op_output     2.12: the selective-checkpoint policy is
                                             called once, after the operator ran, with its
                                             output; earlier torch calls it before the
                                             operator runs, in forward and again in the
                                             recomputation. Fallback: the rule decides from
                                             the operator and its arguments, and a dispatch
                                             mode above torch's caching mode sees the
                                             outputs it kept (`selective_checkpoint_contexts`).
                                             Dynamo does not compile beneath that mode, so
                                             compiled blocks under selective checkpointing
                                             are refused before 2.12
                                             (`require_selective_policy_outputs`).
    torchrun --signals-to-handle             2.10: the agent installs its signal handlers
                                             only for the signals named; earlier agents
                                             install them for SIGTERM, SIGINT, SIGHUP and
                                             SIGQUIT at each worker start, replacing the
                                             launcher's. Fallback: `torchrun_leaves_signals`
                                             has the agent install, for the launcher's
                                             signals, the launcher's own handler.
    DeviceMesh group timeouts                2.10: DeviceMesh passes its backend options'
                                             timeout to new_group; earlier meshes' groups
                                             got new_group's default (30 minutes for gloo),
                                             so a stalled collective hung that long.
                                             Fallback, used on every release (from 2.10 on
                                             it changes nothing): `mesh_groups_time_out_after`
                                             sets that default while the mesh is built.
    UntypedStorage._swap_data_ptr_           private (CUDA graph trees and FSDP use it):
                                             swaps two storages' memory and sizes; absent
                                             from 2.11.0 (the H200 run of 2026-11-28),
                                             present in 2.13.0. Probed once by swapping
                                             two small storages (`STORAGES_SWAP`).
                                             Fallback: stage 3 on the CPU allocates every
                                             gather afresh (zero/gather_buffers.py), and a
                                             group of one copies into its gather buffers
                                             (zero/sole_param_home.py).

Checked on 2.9.1, 2.13.0 and 2.15.0 by running the suite (scripts/test_torch.py); the
releases named above come from reading the 2.10, 2.11 and 2.12 wheels' sources.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import signal
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, create_selective_checkpoint_contexts

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

TORCHRUN_HANDLES_CHOSEN_SIGNALS = "signals_to_handle" in {field.name for field in dataclasses.fields(LaunchConfig)}
SELECTIVE_POLICY_SEES_OUTPUT = "op_output" in inspect.signature(SelectiveCheckpointContext).parameters



def _storages_swap() -> bool:
    """Whether `UntypedStorage._swap_data_ptr_` exists and swaps memory and sizes both ways."""
    if not hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
        return False
    full, empty = torch.UntypedStorage(8), torch.UntypedStorage(0)
    try:
        empty._swap_data_ptr_(full)
    except (RuntimeError, TypeError):
        return False
    return empty.nbytes() == 8 and full.nbytes() == 0


STORAGES_SWAP = _storages_swap()

KeepRule = Callable[[Any, tuple, Any], bool]


class OutputNotComputed:
    """What a selective rule gets as the operator's output on a torch that asks the
    policy before running the operator: any use of it says so."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(
            f"a selective checkpointing rule read the operator's output (.{name}), which torch "
            f"{torch.__version__} does not have yet when it asks the rule (it asks before running the "
            "operator; torch 2.12 and newer ask after): decide from the operator and its arguments")


def require_selective_policy_outputs(feature: str) -> None:
    """Refuse `feature`, which needs the selective-checkpoint policy to see operator outputs."""
    if not SELECTIVE_POLICY_SEES_OUTPUT:
        raise ValueError(
            f"{feature} needs torch 2.12 or newer, and this is torch {torch.__version__}: before 2.12 shardwise's "
            "selective checkpointing runs under a dispatch mode that Dynamo does not compile beneath, so the "
            "blocks would silently run uncompiled. Use another activation_checkpointing policy (\"full\"), "
            "disable compile, or install torch>=2.12")


def selective_checkpoint_contexts(keep: KeepRule, on_kept: Callable[[Any], None]) -> tuple[Any, Any]:
    """torch's selective-checkpoint (forward, recomputation) contexts, caching in forward the
    output of each operator for which `keep(func, args, output)` is true and recomputing
    the rest; `on_kept(output)` is called once for each output cached."""
    if SELECTIVE_POLICY_SEES_OUTPUT:
        def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
            if keep(func, args, ctx.op_output):
                on_kept(ctx.op_output)
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    outputs = _KeptOutputs(on_kept)
    unknown = OutputNotComputed()

    def policy_before_the_operator(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if keep(func, args, unknown):
            outputs.kept = not ctx.is_recompute
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    caching, cached = create_selective_checkpoint_contexts(policy_before_the_operator)
    return _entered_in_order(caching, outputs), cached


class _KeptOutputs(TorchDispatchMode):
    """Entered above torch's caching mode, so each operator passes through here first: the
    policy, called beneath, marks the operator kept, and its output comes back here."""

    def __init__(self, on_kept: Callable[[Any], None]):
        super().__init__()
        self.on_kept = on_kept
        self.kept = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.kept = False
        output = func(*args, **(kwargs or {}))
        if self.kept:
            self.kept = False
            self.on_kept(output)
        return output


@contextmanager
def _entered_in_order(first: Any, second: Any) -> Iterator[None]:
    with first, second:
        yield


def torchrun_signal_options(signals: str) -> list[str]:
    """torchrun options that leave the agent handling only `signals` (comma-separated
    names) itself; none before 2.10, where `torchrun_leaves_signals` does that job."""
    return ["--signals-to-handle", signals] if TORCHRUN_HANDLES_CHOSEN_SIGNALS else []


@contextmanager
def torchrun_leaves_signals(signals: tuple[int, ...]) -> Iterator[None]:
    """Around torchrun's agent: `signals` keep the handlers installed when the block is
    entered, although an agent before 2.10 installs its own for them at each worker start."""
    if TORCHRUN_HANDLES_CHOSEN_SIGNALS:
        yield
        return
    from torch.distributed.elastic.multiprocessing import api

    kept = {signum: handler for signum in signals if callable(handler := signal.getsignal(signum))}
    agents = api._terminate_process_handler

    def handler(signum: int, frame: Any) -> None:
        (kept[signum] if signum in kept else agents)(signum, frame)

    api._terminate_process_handler = handler  # what the agent installs, looked up at each start
    try:
        yield
    finally:
        api._terminate_process_handler = agents


@contextmanager
def mesh_groups_time_out_after(timeout: datetime.timedelta) -> Iterator[None]:
    """Process groups created in the block without a timeout of their own time out after
    `timeout` (torch's defaults are restored afterwards)."""
    from torch.distributed import distributed_c10d

    saved = distributed_c10d.default_pg_timeout, distributed_c10d.default_pg_nccl_timeout
    distributed_c10d.default_pg_timeout = distributed_c10d.default_pg_nccl_timeout = timeout
    try:
        yield
    finally:
        distributed_c10d.default_pg_timeout, distributed_c10d.default_pg_nccl_timeout = saved


def release_info() -> dict[str, str | None]:
    """The running torch's release and the CUDA / HIP releases it was built with, to report
    (DeepSpeed's `git_version_info`, `required_torch_version`), never to choose a code path:
    the detections above do that, by what torch has rather than by its number."""
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)}


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (a checkpointed region's, the activation tracker's) are
    installed on this thread: torch's checkpoint reads the same private accessor, present
    in every supported release."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
