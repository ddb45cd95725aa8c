"""What the engine offers the code built around it, as a typed protocol.

Checkpoints (runtime/checkpoint/), the pipeline schedule (parallel/pipeline/runner.py)
and the front ends (the DeepSpeed API, the Hugging Face Trainer) drive an engine they
are handed. They depend on this protocol, not on the `Engine` class: the engine imports
the checkpoint code and the pipeline runner, so those could not import it back, and the
front ends' own engines (`ConfiguredEngine`, `DeepSpeedEngine`) are engines too.
`Engine` (runtime/engine/engine.py) provides every member (tests/runtime/test_engine_protocol.py).

The ZeRO side is reached through `zero`, whose own protocol (zero/apply.py `ZeroState`)
says what a rank owns, trained and untrained, by parameter name and element range, and
how its optimizer state is encoded; nobody outside zero/ walks its strategy, groups or
store.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from shardwise.runtime.distributed.collectives import CommStats, Communicator
from shardwise.runtime.distributed.mesh import ParallelMesh
from shardwise.runtime.distributed.setup import DistributedContext
from shardwise.runtime.parallel.expert.training import ExpertTraining
from shardwise.runtime.precision import LossScaler
from shardwise.runtime.zero.apply import ZeroState
from shardwise.runtime.zero.sharded_optimizer import ShardedOptimizer
from shardwise.runtime.zero.zenflow import ZenFlow
from shardwise.runtime.data.random_ltd import RandomLTDState


@runtime_checkable
class DataPosition(Protocol):
    """Where a training-data loader is in its data (epoch, samples consumed, seed): JSON
    that a checkpoint saves beside the counters, so a resumed run reads the batch the
    uninterrupted one would have read next (frontends/deepspeed/data_loader.py)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class EngineProtocol(Protocol):
    # -- where it runs ---------------------------------------------------------------------
    rank: int  # this process in the whole job
    world_size: int
    device: torch.device  # where the model computes
    context: DistributedContext  # the process group it joined (collective timeout, local rank)
    mesh: ParallelMesh  # the rank grid: groups by purpose
    world: Communicator  # every rank: collective API calls, checkpoints' agreed failures
    comm_stats: CommStats  # where every communicator of the engine counts its bytes

    # -- what it trains ----------------------------------------------------------------------
    module: nn.Module  # the user's model, after its family's parallelize
    dtype: torch.dtype  # of the parameters the model computes with
    stage: int  # the ZeRO stage
    trains: bool  # False: given no optimizer, the engine runs forward only
    zero: ZeroState  # parameters, shards, gradients and optimizer, through ZeroState's protocol
    optimizer: ShardedOptimizer | None  # `zero.optimizer`: the torch optimizer on this rank's segments
    lr_scheduler: Any  # the caller's or the policies' scheduler: any object with step(); or None
    zenflow: ZenFlow | None  # ZenFlow's step (zero/zenflow.py), when the policy asks for it
    experts: ExpertTraining | None  # experts of expert-parallel layers, trained apart from ZeRO (ep_size > 1)
    expert_lr_scheduler: Any  # the experts' own schedule (None without experts or a schedule)
    loss_scaler: LossScaler

    # -- counters a checkpoint saves and restores ---------------------------------------------
    gradient_accumulation_steps: int  # micro-batches per optimizer step
    global_steps: int  # optimizer steps taken (skipped ones included)
    micro_steps: int  # micro-batches run
    skipped_steps: int  # steps an overflow or a failed backward skipped
    last_grad_norm: float | None  # of the last step's gradient, unscaled and unclipped
    data_position: DataPosition | None  # the loader a front end built for the engine: saved and restored with it
    pending_data_position: dict | None  # loaded before the loader was attached (attach_data_position)
    random_ltd: RandomLTDState | None  # random-LTD's schedule (current kept tokens, consumed layer-tokens)

    # -- the training step ---------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Gradients of `loss`, reduced (or sharded) while backward runs."""

    def step(self) -> None:
        """The update at an accumulation boundary; otherwise only counts the micro-batch."""

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next `step()` applies an update."""

    def get_lr(self) -> list[float]:
        """Each param group's learning rate ([] without an optimizer)."""

    # -- a pipeline stage's backward, driven by the schedule ------------------------------------
    def backward_with_gradients(self, tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], *,
                                boundary: bool, loss: torch.Tensor) -> None:
        """One backward from `tensors` with their given gradients, bracketed by ZeRO as
        `backward(loss)` is; `boundary`: this rank's last backward of the window."""

    def step_after_schedule(self, micro_batches: int) -> None:
        """`micro_batches` backwards made one accumulation window: count them and step."""
