"""The training engine: forward, backward and step, read top to bottom.

    job = start_job(model, policies)                     # process group, agreement, mesh
    model = parallelize(model, mesh=job.mesh, ...)       # the model family's steps (shardwise/models/)
    engine = Engine(model, job=job, policies=policies, optimizer=...)
    loss = engine(batch)        # the user's forward
    engine.backward(loss)       # gradients reduced/sharded while backward runs (or loss.backward():
                                # engine/output_backward.py)
    engine.step()               # at accumulation boundaries: check, clip, update, gather

The engine is built from typed policies (engine/policies.py) and knows no config format;
front ends (`shardwise.initialize` for DeepSpeed configs, `shardwise.build_engine` in
Python) run the three lines above. The engine's own part is ZeRO, the last step of the
apply order (tensor -> sequence -> activation checkpointing -> compile -> pipeline ->
ZeRO): it takes over the parameters (zero/apply.py). Everything stage-specific lives
behind `self.zero`: the parameter strategy, the shard store, the gradient reducer and the
sharded optimizer. A model split into pipeline stages is run by `train_batch` /
`eval_batch` (parallel/pipeline/runner.py). What code built around the engine may use of
it (checkpoints, the pipeline runner, the front ends) is runtime/engine_protocol.py.
"""

from __future__ import annotations

import logging
import os
import weakref
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardwise.runtime.accounting import MemoryLedger
from shardwise.runtime.activation.accounting import ActivationTracker
from shardwise.runtime.checkpoint.background import BackgroundWriter
from shardwise.runtime.data.random_ltd import RandomLTDState, random_ltd_state
from shardwise.runtime.engine_protocol import DataPosition
from shardwise.runtime.distributed.blocked_waits import AbandonedWait, watch_blocked_waits, watched_check
from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.distributed.setup import call_check_timeout
from shardwise.runtime.engine.arguments import make_scheduler, optimizer_factory, refuse_second_engine
from shardwise.runtime.engine.job import Job
from shardwise.runtime.engine.output_backward import EngineBackward, OutputBackward
from shardwise.runtime.engine.policies import Policies
from shardwise.runtime.engine.trial import TrialMeter
from shardwise.runtime.optim.registry import optimizer_spec
from shardwise.runtime.optim.sharded import ShardAwareOptimizer
from shardwise.runtime.optim.zero_gradient_step import step_on_zero_gradients
from shardwise.runtime.parallel.pipeline.runner import PipelineRunner
from shardwise.runtime.parallel.pipeline.split import StageLayout
from shardwise.runtime.parallel.pipeline.stages import keep_stage_parameters, stage_of
from shardwise.runtime.parallel.tensor.grad_norm import tensor_parallel_norm
from shardwise.runtime.parallel.tensor.layers import gather_vocab_logits
from shardwise.runtime.parallel.tensor.placement import is_tensor_sharded
from shardwise.runtime.precision import LossScaler
from shardwise.runtime.precision.casting import autocast_for, cast_floating, cast_unheld_state
from shardwise.runtime.reliability.replica_check import ReplicaCheck
from shardwise.runtime.reliability.pass_failures import PassFailures
from shardwise.runtime.reliability.step_guard import BACKWARD, FORWARD, StepGuard
from shardwise.runtime.parallel.expert.training import (
    ExpertTraining,
    connect_expert_layers,
    expert_parameters,
    global_expert_places,
)
from shardwise.runtime.zero.apply import ZeroGroups, apply_zero
from shardwise.runtime.zero.parked_states import ParkedStates, StateKind, optimizer_state_tensors
from shardwise.runtime.zero.zenflow import ZenFlow
from shardwise.runtime.zero.trainable import evaluated_parameters, frozen_parameters, trainable_parameters

if TYPE_CHECKING:
    from shardwise.runtime.checkpoint.load import OpenedCheckpoint

log = logging.getLogger("shardwise")

# what each call needs on the device (offload_states moves them off)
FORWARD_STATES = frozenset({StateKind.PARAMETERS})
BACKWARD_STATES = frozenset({StateKind.PARAMETERS, StateKind.GRADIENTS, StateKind.GRADIENT_BUCKETS})
EVERY_STATE = frozenset(StateKind)


class Engine(nn.Module):
    """An nn.Module around the model (`engine.module`): train()/eval() set its mode, and
    attributes the engine lacks are the model's (`engine.gradient_checkpointing_enable()`)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        job: Job,
        policies: Policies,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
    ):
        """`model` has been through its family's `parallelize` on `job.mesh`; `optimizer`
        (any torch optimizer over its parameters) or `policies.optimizer` trains it, else
        the engine runs forward only (front ends have checked they are not both given:
        `shardwise.build_engine`). `param_init_fn(module)` materialises a module built on
        the meta device (stage 3; default `module.reset_parameters()`)."""
        super().__init__()
        refuse_second_engine(model)
        self.policies = policies
        self.job = job
        self.context = job.context
        self.device = job.context.device
        self.rank = job.context.rank
        self.world_size = job.context.world_size
        self.mesh = job.mesh
        self.world = job.world
        self.comm_stats = job.stats
        self.ledger = MemoryLedger()
        self.activations = ActivationTracker(self.ledger)  # "activations" in memory_breakdown()
        groups = ZeroGroups(*(
            Communicator(self.mesh[purpose], self.comm_stats, self.ledger, job.peers)
            if purpose in self.mesh.handles else None
            for purpose in ("shard", "replicate", "replicas", "secondary", "shard_node", "shard_nodes")
        ))
        self.comm = groups.replicas  # the data-parallel group (losses, barriers)

        self.module = model
        optimizer = keep_stage_parameters(optimizer, model)  # a pipeline stage trains only its layers
        zero = policies.zero
        self.stage = zero.stage
        self.dtype = policies.precision.param_dtype
        if any(param.is_meta for param in model.parameters()) and not zero.partitions_parameters:
            raise ValueError(
                "the model has parameters on the meta device; only ZeRO stage 3 can build "
                "it partitioned (set zero_optimization.stage to 3)"
            )
        if not any(param.is_meta for param in model.parameters()):
            model.to(self.device)
        self.trains = optimizer is not None or policies.optimizer is not None  # else forward only (evaluation)
        if not self.trains:
            gather_vocab_logits(model)  # its callers sample or take log-probabilities: whole logits
        named = trainable_parameters(model, optimizer) if self.trains else evaluated_parameters(model)
        self.experts: ExpertTraining | None = None
        if connect_expert_layers(model, self.mesh, self.comm_stats, self.ledger, job.peers) and self.trains:
            named, self.experts = self._train_experts_apart(named, optimizer, policies)
        spec = optimizer_spec(policies.optimizer.type) if policies.optimizer is not None else None
        self.zero = apply_zero(
            model, named, policy=zero, precision=policies.precision, groups=groups, ledger=self.ledger,
            device=self.device,
            make_optimizer=optimizer_factory(optimizer, policies.optimizer) if self.trains else None,
            codec=spec.codec if spec is not None else getattr(optimizer, "state_codec", None),
            param_init_fn=param_init_fn,
            per_parameter=spec.per_parameter if spec is not None else isinstance(optimizer, ShardAwareOptimizer),
            frozen=frozen_parameters(model, named + (self.experts.params if self.experts is not None else [])),
        )
        self.optimizer = self.zero.optimizer
        self.parked = ParkedStates()  # states moved off the device by offload_states()
        self.tensor_norm = tensor_parallel_norm(self.mesh, self.zero, self.comm_stats) if self.trains else None
        self.units = self.zero.units
        self.ledger.hold("params", cast_unheld_state(model, self.dtype, held=set(self.zero.unit_of_param)))
        hooked = self.zero.reducer if self.trains else self.zero.params  # what holds hooks on the parameters
        for param in model.parameters():
            param._shardwise_zero = weakref.ref(self.zero)  # gathered_parameters (zero/gathered.py)
            param._shardwise_hooks = weakref.ref(hooked)

        training = policies.training
        self.gradient_accumulation_steps = training.gradient_accumulation_steps
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self.data_position: DataPosition | None = None  # a front end's loader, checkpointed with the engine
        self.pending_data_position: dict[str, Any] | None = None  # see attach_data_position
        # random-LTD's schedule, shared by the layers the model family's parallelize wrapped
        self.random_ltd: RandomLTDState | None = random_ltd_state(model)
        self.zenflow = self._zenflow_for(policies) if self.trains else None
        # what each loss is divided by: the accumulation count (ZenFlow's update interval)
        self.loss_divisor = (self.zenflow.update_interval if self.zenflow is not None
                             else self.gradient_accumulation_steps)
        if self.trains and policies.precision.initial_zero_gradient_step:
            step_on_zero_gradients(self.optimizer.optimizer)
            if self.experts is not None:  # DeepSpeed's wrapper steps the experts' groups too
                step_on_zero_gradients(self.experts.optimizer)
        self.lr_scheduler = (make_scheduler(lr_scheduler, policies.scheduler, self.optimizer.optimizer)
                             if self.trains else None)
        self.expert_lr_scheduler = self._expert_scheduler(lr_scheduler, policies)
        self.loss_scaler = LossScaler.from_policy(policies.precision.loss_scaling)
        self.guard = StepGuard(self.comm, groups.replicate.size, training.max_consecutive_skipped_steps)
        self.replica_check = self._replica_check(training.replica_check_interval)
        self.pipeline = self._pipeline_runner_for(model)  # train_batch / eval_batch
        self._backward_pending = False  # backward() ran and step() has not yet
        self.backwards_in_window = 0  # backward passes summed into the current window's gradients
        self._ending_window = False  # step() is ending a window the caller owns (caller_ends_windows)
        self._check_caller_ended_windows()
        # a backward the script starts itself on the forward's outputs (engine/output_backward.py)
        self._output_backward = (OutputBackward(on_open=self._open_output_pass, on_close=self._end_pass,
                                                divisor=lambda: self.loss_divisor) if self.trains else None)
        if self._output_backward is not None:
            self._output_backward.watch_parameters([param for param in model.parameters() if param.requires_grad])
        self._scaled_by_script = False  # engine.scale(loss) ran for the next such backward
        # the forward itself gathers (stage 3) or reduces (tensor / sequence parallel)
        self._forward_communicates = (zero.partitions_parameters or policies.tensor.size > 1
                                      or policies.sequence.size > 1)
        self._checkpoint_writer: BackgroundWriter | None = None  # made at the first asynchronous save
        self.pass_failures = self._pass_failures_for(policies)
        self._destroyed = False
        self.reset_comm_volume()
        # what an automatic resume loaded (CheckpointPolicy.resume_from; shardwise.build_engine)
        self.resumed_client_state: dict | None = None
        # an autotuning trial (shardwise tune / DeepSpeed's autotuner): metrics after a few steps, then exit
        self.trial = (TrialMeter(policies.trial, writes=self.rank == 0)
                      if policies.trial is not None and self.trains else None)

    # -- the training step ---------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The user's forward; floating-point inputs are cast to the compute dtype, and it
        runs under `torch.autocast` when the precision policy says so. If it raises,
        whatever it left gathered or in use is released first."""
        self._require_alive("forward")
        self._require_states("forward", FORWARD_STATES)
        self._drop_interrupted_pass()
        if self._backward_pending and self._forward_communicates:
            self.guard.check_call(FORWARD, self.get_lr())  # pairs with a peer's step check if it skipped one
        args, kwargs = cast_floating((args, kwargs), self.dtype)
        if self.policies.random_ltd is not None and self.module.training:
            self._require_random_ltd_layers().update_seq(self.global_steps)  # the kept-token count for this step
        if self.pass_failures is not None:
            self.pass_failures.begin_pass()
        try:
            counted = self.activations.track() if self.policies.activation.count_saved else nullcontext()
            with counted, autocast_for(self.policies.precision, self.device):
                output = self.module(*args, **kwargs)
        except BaseException as error:
            self.zero.params.abort_pass()
            self.guard.note_failed_pass()
            self._stop_if_raised_alone(error)
            raise
        if self._output_backward is not None and self.pipeline is None and torch.is_grad_enabled():
            self._output_backward.attach(output)  # the script may call backward on it itself
        return output

    def _require_random_ltd_layers(self) -> RandomLTDState:
        if self.random_ltd is None:
            raise RuntimeError(
                f"random-LTD is enabled (data_efficiency.data_routing.random_ltd) but no layer of "
                f"{type(self.module).__name__} drops tokens: shardwise knows the layers of its own GPT and Hugging "
                "Face Llama-style models only; wrap yours with DeepSpeed's "
                "convert_to_random_ltd(engine, LayerClass) after initialize (as DeepSpeed requires), or give a "
                "ModelPlan with `layers` (docs/parallelism.md#your-own-model)")
        return self.random_ltd

    def _pass_failures_for(self, policies: Policies) -> PassFailures | None:
        """With a tensor- or sequence-parallel group on gloo, a forward or backward that
        raises on some of its ranks only is named on every rank at once
        (reliability/pass_failures.py). NCCL's collectives do not block the host, so a
        peer would never read the note: there the raising rank raises its own error."""
        if (policies.tensor.size == 1 and policies.sequence.size == 1) or not dist.is_initialized():
            return None
        groups = [self.mesh[purpose] for purpose in ("tensor", "sequence")
                  if purpose in self.mesh.handles and self.mesh[purpose].group is not None]
        if any(dist.get_backend(handle.group) != "gloo" for handle in groups):
            return None
        peers = {rank for handle in groups for rank in handle.ranks}
        failures = PassFailures(self.rank, peers, self.context.timeout.total_seconds())
        watch_blocked_waits(failures.check_blocked)
        return failures

    def _stop_if_raised_alone(self, error: BaseException) -> None:
        """After this rank's forward or backward raised `error`: raise instead the error that
        says it raised on some ranks of its tensor/sequence group only, if it did."""
        if self.pass_failures is None or isinstance(error, AbandonedWait):
            return
        diverged = self.pass_failures.raised(error)
        if diverged is not None:
            raise diverged from error

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the coming backward/step ends the window. With `caller_ends_windows`
        (DeepSpeed's managed_gradient_accumulation false) every step() ends it, so this is
        true only while step() runs, as in DeepSpeed."""
        if self.policies.training.caller_ends_windows:
            return self._ending_window
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def _check_caller_ended_windows(self) -> None:
        """`caller_ends_windows` is built for ZeRO 0-3 beside tensor, sequence and expert
        parallelism (the experts' gradients accumulate in autograd and are reduced in
        `step()` whatever the window): the pipeline's schedule, ZenFlow and the compressed
        optimizers end windows on their own count."""
        if not self.policies.training.caller_ends_windows or not self.trains:
            return
        own_count = ("a pipeline runs its schedule's micro-batches per step" if self.pipeline is not None
                     else "ZenFlow accumulates over its own update interval" if self.zenflow is not None
                     else "this optimizer exchanges the window's local gradients itself"
                     if self.zero.reducer.optimizer_exchanges else None)
        if own_count is not None:
            raise ValueError(f"caller_ends_windows (DeepSpeed's managed_gradient_accumulation false) is not "
                             f"supported here: {own_count}; let the engine count the window")

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's and DeepSpeed's `no_sync`: backward passes inside accumulate gradients on
        this rank without communicating; the first backward after the block reduces all of
        them, and `step()` follows it. Stages 0-1 only: stages 2-3 keep a gradient
        partition, which needs a reduction every micro-batch."""
        self._require_training("no_sync")
        if not self.policies.zero.keeps_full_gradients:
            raise RuntimeError(f"engine.no_sync() needs ZeRO stage 0 or 1: stage {self.stage} keeps only a "
                               "partition of the gradients, so every backward must reduce (DeepSpeed refuses it too)")
        self.zero.reducer.sync_in_backward = False
        try:
            yield
        finally:
            self.zero.reducer.sync_in_backward = True

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False, averaged: bool = True) -> None:
        """Backward of `loss` averaged over accumulation steps and scaled for fp16. Called
        several times before one step() (one call per loss, as DeepSpeedExamples' GAN
        does), the gradients add up, as they would for the sum of the losses.
        `retain_graph`: autograd's, for a later backward through the same graph;
        `averaged=False`: the loss is not divided by the accumulation steps (the caller
        has averaged it over its window itself: DeepSpeed's `scale_wrt_gas=False`)."""
        self._require_training("backward")
        self._drop_interrupted_pass()
        self._scaled_by_script = False  # an engine.scale() this backward made unnecessary counts for no other
        scale = self.loss_scaler.scale / (self.loss_divisor if averaged else 1)
        self._begin_pass(loss)
        try:
            with EngineBackward():
                (loss.float() * scale).backward(retain_graph=retain_graph)
        except BaseException as error:
            self._abort_backward()
            self._stop_if_raised_alone(error)
            raise
        self._end_pass()

    def _begin_pass(self, loss: torch.Tensor) -> None:
        """Open a backward (the engine's own, or one the script started on the outputs):
        ZeRO's reducer told whether it ends the window, the step check told a micro-batch
        ran. Inside no_sync it only accumulates: no window ends, nothing is checked."""
        self._require_states("backward", BACKWARD_STATES)
        synced = self.zero.reducer.sync_in_backward
        if synced and self._backward_pending:
            self.guard.check_call(BACKWARD, self.get_lr())  # pairs with a peer's step check if it skipped one
        self.zero.reducer.begin_backward(boundary=synced and self.is_gradient_accumulation_boundary())
        self.guard.note_loss(loss)

    def _end_pass(self) -> None:
        """Close the backward `_begin_pass` opened, once autograd has run it: the reductions
        it launched complete (a failure drops it, as a failed backward is dropped)."""
        try:
            self.zero.reducer.end_backward()
        except BaseException as error:
            self._abort_backward()
            self._stop_if_raised_alone(error)
            raise
        synced = self.zero.reducer.sync_in_backward
        if synced:
            self.zero.params.end_backward()
        # a window the caller ends is reduced in step(), so it may hold no_sync backwards only
        self._backward_pending |= synced or self.policies.training.caller_ends_windows
        self.backwards_in_window += 1

    def backward_with_gradients(self, tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], *,
                                boundary: bool, loss: torch.Tensor) -> None:
        """One backward from `tensors` with their given gradients: a pipeline stage's, whose
        outputs' gradients come from the next stage already scaled (the last stage's loss is
        scaled by the caller, as `backward` scales it). ZeRO brackets it as it brackets
        `backward(loss)`; `boundary`: this rank's last backward of the window, where stages
        0-1 reduce. `loss` (the stage's, or zero) goes to the step check."""
        self.zero.reducer.begin_backward(boundary=boundary)
        self.guard.note_loss(loss)
        try:
            if tensors:  # a stage of parameter-free layers fed by the data has nothing to differentiate
                with EngineBackward():
                    torch.autograd.backward(tensors, grads)
            self.zero.reducer.end_backward()
        except BaseException:
            self._abort_backward()
            raise
        self.zero.params.end_backward()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call `.backward()` on yourself: multiplied by the loss scale where
        fp16 loss scaling is on (else `loss` itself), as DeepSpeed's `engine.scale`. The
        engine divides by the accumulation count during that backward
        (engine/output_backward.py)."""
        self._require_training("scale")
        if loss.dim() != 0 or loss.grad_fn is None:
            raise ValueError(f"engine.scale(loss): the loss must be a scalar tensor with a gradient function (got "
                             f"shape {tuple(loss.shape)}, grad_fn {loss.grad_fn}); for another tensor call "
                             "tensor.backward(gradient) yourself")
        if self.policies.precision.loss_scaling is None:
            return loss
        self._scaled_by_script = True
        return loss.float() * self.loss_scaler.scale

    def _open_output_pass(self, gradient: torch.Tensor) -> None:
        """A backward the script started on this engine's outputs reached them: begin it as
        `backward` begins its own (the output's gradient goes to the step check in place of
        the loss: a non-finite loss makes it non-finite)."""
        if self.policies.precision.loss_scaling is not None and not self._scaled_by_script:
            raise RuntimeError("Loss scaling is required for this configuration, but backward() was called directly "
                               "without scaling the loss. Please use one of the following: 1. engine.backward(loss) "
                               "2. engine.scale(loss).backward()")
        self._scaled_by_script = False
        self._begin_pass(gradient)

    def _drop_interrupted_pass(self) -> None:
        """A backward the script started raised before autograd finished it: drop it as a
        failed `backward` is dropped, before anything else runs."""
        if self._output_backward is None or not self._output_backward.open:
            return
        self._output_backward.open = False
        log.warning("shardwise: a backward started on the engine's outputs raised before it finished; its "
                    "micro-batch is dropped")
        self._abort_backward()

    def _abort_backward(self) -> None:
        """A backward raised (on every rank alike, or the step check will say otherwise):
        finish its collectives and drop its gradients. If it was the first micro-batch of
        an accumulation window, training continues exactly as if the batch had never been
        seen. Later in a window, the earlier micro-batches' gradients are mixed with
        partial ones, so the whole window is dropped and the next micro-batch starts a new
        one (counted in `skipped_steps`, and logged)."""
        self.guard.note_failed_pass()
        try:
            self.zero.reducer.abort_backward()
        finally:
            self.zero.params.abort_pass()
            self.zero.reducer.discard_window()
            self.guard.forget_window()
            caller_ends = self.policies.training.caller_ends_windows
            into_window = (self.backwards_in_window if caller_ends
                           else self.micro_steps % self.gradient_accumulation_steps)
            self.backwards_in_window = 0
            if into_window:
                if not caller_ends:
                    self.micro_steps -= into_window
                self.skipped_steps += 1
                if self.rank == 0:
                    log.warning("shardwise: backward raised in micro-batch %d of an accumulation window; "
                                "the window's %d earlier micro-batch(es) are dropped with it",
                                into_window + 1, into_window)

    def step(self) -> None:
        """Apply the update at an accumulation boundary; otherwise only count the micro-step."""
        self._require_training("step")
        self._require_states("step", EVERY_STATE)
        self._drop_interrupted_pass()
        if not self.zero.reducer.sync_in_backward:
            raise RuntimeError("engine.step() inside engine.no_sync(): the gradients there are not reduced yet; "
                               "call backward() inside the block and backward() + step() after it")
        if not self._backward_pending:
            raise RuntimeError(
                "engine.step() was called without a backward since the last step: there is no gradient to "
                "apply. Call engine.backward(loss) (or loss.backward() on the engine's output) first"
            )
        caller_ends = self.policies.training.caller_ends_windows
        self._ending_window = caller_ends
        try:
            self._step(caller_ends)
        finally:
            self._ending_window = False

    def _step(self, caller_ends: bool) -> None:
        """`step()` past its checks; `caller_ends`: this step ends the window whatever the
        count (its reductions run here: zero/gradients.py, `finish_window`)."""
        boundary = self.is_gradient_accumulation_boundary()
        if boundary and self.policies.zero.refuse_unused_parameters:
            self.zero.reducer.refuse_unused_parameters(self.comm)  # before anything of the step happens
        if caller_ends:
            self.zero.reducer.finish_window()
        self._backward_pending = False
        self.micro_steps += self.gradient_accumulation_steps if caller_ends else 1
        if not boundary:
            return
        self.backwards_in_window = 0
        scale = self.loss_scaler.scale  # the scale this step's gradients carry
        norm_squared = self.optimizer.local_grad_norm_squared()
        if self.experts is not None:
            self.experts.reduce_gradients()
            norm_squared = norm_squared + self.experts.norm_squared_share(self.guard.replicate_size).to(norm_squared)
        if self.tensor_norm is not None:  # tensor shards summed, replicated parameters counted once
            norm_squared = self.tensor_norm(norm_squared)
        if self.pipeline is not None:  # stages hold disjoint parameters: their squares add up
            norm_squared = self.pipeline.combine_norm(norm_squared)
        verdict = self.guard.check(norm_squared, self.loss_scaler, self.global_steps, self.get_lr())
        self.last_grad_norm = verdict.norm
        self.loss_scaler.update(not verdict.apply)
        if verdict.apply and self.zenflow is not None:  # clips the window's sum when the CPU updates
            self.zenflow.step(self.micro_steps - 1, grad_scale=1 / scale,
                              max_norm=self.policies.training.gradient_clipping)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        elif verdict.apply:
            clip = 1.0
            max_norm = self.policies.training.gradient_clipping
            if max_norm > 0:
                clip = min(1.0, max_norm / (verdict.norm + 1e-6))
            self.optimizer.step(grad_scale=clip / scale)
            if self.experts is not None:
                self.experts.step(grad_scale=clip / scale)
            self.zero.params.after_update()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            if self.expert_lr_scheduler is not None:
                self.expert_lr_scheduler.step()
        else:
            self.skipped_steps += 1
        self.zero.reducer.zero_grads()
        if self.experts is not None:
            self.experts.zero_grads()
        self.global_steps += 1
        if self.replica_check is not None and self.replica_check.due(self.global_steps):
            self.replica_check.check(list(self.module.named_parameters()), f"after optimizer step {self.global_steps}")
        if self.trial is not None:
            self.trial.after_step(self.global_steps)

    def _expert_scheduler(self, lr_scheduler: Any, policies: Policies) -> Any:
        """The schedule of the experts' own optimizer: the same schedule, built over its groups.
        A scheduler object built before `initialize` holds the optimizer the experts were
        taken out of, so it would leave their rate at its start: refused with the fix."""
        if self.experts is None or self.lr_scheduler is None:
            return None
        if policies.scheduler is None and hasattr(lr_scheduler, "step"):
            raise ValueError("expert parallelism (ep_size > 1) trains the experts with an optimizer of their own, "
                             "which a scheduler object built before initialize cannot reach: give the scheduler as "
                             "the config's scheduler block or as a callable that builds it from an optimizer "
                             "(lr_scheduler=lambda optimizer: ...)")
        return make_scheduler(lr_scheduler, policies.scheduler, self.experts.optimizer)

    def _train_experts_apart(self, named: list[tuple[str, nn.Parameter, int]], optimizer: torch.optim.Optimizer | None,
                             policies: Policies) -> tuple[list[tuple[str, nn.Parameter, int]], ExpertTraining | None]:
        """The dense parameters for ZeRO, and the experts of expert-parallel layers trained
        apart (parallel/expert/training.py explains why)."""
        experts = expert_parameters(named)
        if not experts:
            return named, None
        precision = policies.precision
        if (self.mesh.sizes.sequence > 1 or precision.master_dtype != torch.float32
                or policies.zero.zenflow is not None or policies.zero.sum_gradients
                or precision.accumulation_dtype != precision.param_dtype):
            raise ValueError("expert parallelism (ep_size > 1) is provided for fp32, bf16 and fp16 (fp32 masters; "
                             "fp16's loss scaling covers the experts' gradients) data-, tensor- and pipeline-parallel "
                             "training (ZeRO 0-3; not sequence parallelism, bf16 masters, ZenFlow, "
                             "gradient_allreduce_op \"sum\", the experts' gradients are always averaged, or "
                             "data_types.grad_accum_dtype fp32, they sum micro-batches in the training dtype); use "
                             "ep_size=1 for the others")
        if self.mesh.sizes.tensor > 1 and not all(is_tensor_sharded(param) for _, param, _ in experts
                                                  if param.dim() >= 2):  # the experts' matrices: biases may stay whole
            raise ValueError("expert parallelism (ep_size > 1) with tensor_parallel.size > 1 needs experts split "
                             "by the tensor group (a Hugging Face Mixtral's are); these experts are whole on every "
                             "tensor rank (DeepSpeed's MoE without enable_expert_tensor_parallelism=True): use "
                             "tensor_parallel.size 1 or ep_size 1")
        ids = {id(param) for _, param, _ in experts}
        build: Callable[[list[dict]], torch.optim.Optimizer]
        if optimizer is not None:
            groups, index = ExpertTraining.split_optimizer(optimizer, ids)
            build = type(optimizer)
            named = [(name, param, index[group]) for name, param, group in named if id(param) not in ids]
        else:
            groups = [{"params": [param for _, param, _ in experts]}]
            spec, hyper = optimizer_spec(policies.optimizer.type), dict(policies.optimizer.params)
            build = lambda groups: spec.build(groups, hyper)  # noqa: E731
            named = [entry for entry in named if id(entry[1]) not in ids]
        expert_data = {size: Communicator(self.mesh.expert_handles(size)[1], self.comm_stats, self.ledger,
                                          self.job.peers)
                       for size in sorted({size for _, _, size in experts})}
        return named, ExpertTraining(experts, groups, build, expert_data, data_size=self.mesh.data_size,
                                     partitioned=policies.zero.partitions_model_states, ledger=self.ledger,
                                     global_places=global_expert_places(self.module), dtype=precision.param_dtype,
                                     tensor_size=self.mesh.sizes.tensor)

    def _replica_check(self, interval: int) -> ReplicaCheck | None:
        if not interval:
            return None
        if self.policies.zero.partitions_parameters:
            raise ValueError(f"replica_check.interval {interval}: the replica check compares whole parameters, and "
                             "ZeRO stage 3 keeps only a shard of each on a rank; use it at stages 0-2 (set it to 0)")
        return ReplicaCheck(self.comm, interval)

    def _zenflow_for(self, policies: Policies) -> ZenFlow | None:
        """ZenFlow's step (zero/zenflow.py) when the policy asks for it; it accumulates over
        its own update interval, so the engine's accumulation count must be 1."""
        if policies.zero.zenflow is None:
            return None
        if self.gradient_accumulation_steps != 1:
            raise ValueError(f"ZenFlow accumulates gradients over zenflow.update_interval itself (DeepSpeed replaces "
                             f"gradient_accumulation_steps by it); got gradient_accumulation_steps "
                             f"{self.gradient_accumulation_steps}: set it to 1")
        if policies.precision.loss_scaling is not None:
            raise ValueError("ZenFlow with fp16 loss scaling is not supported: a skipped step would leave the "
                             "device's selective update and the host's window sum apart; use bf16 or fp32")
        if self.mesh.sizes.size("pipeline") > 1 or self.mesh.sizes.size("tensor") > 1:
            raise ValueError("ZenFlow with pipeline or tensor parallelism is not supported: use data parallelism")
        return ZenFlow(policies.zero.zenflow, optimizer=self.optimizer, params=self.zero.params,
                       shard=self.zero.groups.shard, ledger=self.ledger, device=self.device)

    # -- pipeline parallelism: DeepSpeed's PipelineEngine calls ------------------------------
    def _pipeline_runner_for(self, model: nn.Module) -> PipelineRunner | None:
        split = stage_of(model)
        if split is None:
            return None
        adapter, layout = split
        pipeline = self.policies.pipeline
        micro_batches = pipeline.micro_batches or self.gradient_accumulation_steps
        return PipelineRunner(self, adapter=adapter, layout=layout, schedule=pipeline.schedule,
                              micro_batches=micro_batches)

    def train_batch(self, data_iter: Iterable[Any] | None = None,
                    loss_fn: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """Run the pipeline's micro-batches (`PipelinePolicy.micro_batches`, default the
        accumulation steps) through the schedule, then one optimizer step; returns the
        batch's mean loss on every rank."""
        self._require_training("train_batch")  # before any stage starts: every rank refuses alike
        self._require_states("train_batch", EVERY_STATE)
        pipeline = self._running_pipeline("train_batch")
        micro_batches = _iterator(data_iter, "train_batch")
        if self.micro_steps % self.gradient_accumulation_steps or self._backward_pending:
            raise RuntimeError("engine.train_batch() in the middle of an accumulation window started with "
                               "engine.backward(): call engine.step() until the window ends first")
        return pipeline.run(micro_batches, loss_fn, train=True)

    def step_after_schedule(self, micro_batches: int) -> None:
        """The pipeline schedule ran `micro_batches` backwards (`backward_with_gradients`):
        they make one accumulation window, which ends in a step."""
        self.micro_steps += micro_batches - 1
        self._backward_pending = True
        self.step()

    def eval_batch(self, data_iter: Iterable[Any] | None = None,
                   loss_fn: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """The mean loss of one batch of micro-batches, forward only, no update."""
        return self._running_pipeline("eval_batch").run(_iterator(data_iter, "eval_batch"), loss_fn, train=False)

    def is_first_stage(self) -> bool:
        return self.pipeline is None or self.pipeline.layout.first

    def is_last_stage(self) -> bool:
        return self.pipeline is None or self.pipeline.layout.last

    def pipeline_layout(self) -> StageLayout | None:
        """This rank's stage: the layer indices of each chunk (None without a pipeline)."""
        return None if self.pipeline is None else self.pipeline.layout

    def _running_pipeline(self, call: str) -> PipelineRunner:
        self._require_alive(call)
        if self.pipeline is None:
            raise RuntimeError(f"engine.{call}() runs the pipeline schedule: set pipeline_parallel.size > 1, or "
                               "train with engine(batch), engine.backward(loss) and engine.step()")
        return self.pipeline

    # -- checkpoints (runtime/checkpoint/) ----------------------------------------------
    def attach_data_position(self, loader: DataPosition) -> None:
        """Give the engine the loader a front end built for it: checkpoints save where it is
        and loads put it back. A position loaded before the loader existed (the automatic
        resume at construction, CheckpointPolicy.resume_from) is applied to it now."""
        if self.pending_data_position is not None:
            loader.load_state_dict(self.pending_data_position)
            self.pending_data_position = None
        self.data_position = loader

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None,
                        client_state: dict | None = None, *, asynchronous: bool | None = None,
                        exclude_frozen_parameters: bool = False) -> str:
        """Write this rank's shard of everything needed to resume; returns the tag.
        Asynchronous (`asynchronous`, default `CheckpointPolicy.asynchronous`): returns once
        the state is copied to host memory, and a background thread writes and publishes
        it (checkpoint/background.py); `wait_for_checkpoint()` joins it.
        `exclude_frozen_parameters`: without the parameters nothing trains (checkpoint/save.py)."""
        from shardwise.runtime.checkpoint import save_checkpoint

        self._require_alive("save_checkpoint")
        self._require_states("save_checkpoint", EVERY_STATE)
        self.world.agree_on_call("save_checkpoint", call_check_timeout(self.context.timeout))
        self.wait_for_checkpoint()  # one save at a time; an earlier write's failure raises here
        if self.replica_check is not None:  # never save replicas that diverged
            self.replica_check.check(list(self.module.named_parameters()), "before saving a checkpoint")
        asynchronous = self.policies.checkpoint.asynchronous if asynchronous is None else asynchronous
        return save_checkpoint(self, save_dir, tag, client_state,
                               writer=self._background_writer() if asynchronous else None,
                               exclude_frozen=exclude_frozen_parameters)

    def wait_for_checkpoint(self) -> None:
        """Wait until the asynchronous save in progress (if any) is published; raises its
        failure, on every rank. The next save, a load and `destroy()` call it too."""
        if self._checkpoint_writer is not None:
            self._checkpoint_writer.wait()

    def _background_writer(self) -> BackgroundWriter:
        if self._checkpoint_writer is None:
            self._checkpoint_writer = BackgroundWriter(world_size=self.world_size, timeout=self.context.timeout,
                                                       device=self.device)
        return self._checkpoint_writer

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None, *,
                        optimizer_states: bool = True, module_only: bool = False, strict: bool = True,
                        opened: OpenedCheckpoint | None = None) -> dict:
        """Resume from a checkpoint (any world size or stage); returns its client_state.
        `optimizer_states=False` / `module_only=True`: load the weights only; `strict=False`:
        into a model with more or fewer tensors; `opened`: a checkpoint of another format,
        opened by its front end (see checkpoint/load.py)."""
        from shardwise.runtime.checkpoint import load_checkpoint

        self._require_alive("load_checkpoint")
        self._require_states("load_checkpoint", EVERY_STATE)
        self.world.agree_on_call("load_checkpoint", call_check_timeout(self.context.timeout))
        self.wait_for_checkpoint()  # never read a checkpoint while one is being written
        return load_checkpoint(self, load_dir, tag, optimizer_states=optimizer_states, module_only=module_only,
                               strict=strict, opened=opened)

    # -- states moved off the device between phases (zero/parked_states.py) ---------------
    def offload_states(self, include: Iterable[StateKind | str] | None = None, *, pin_memory: bool = True,
                       non_blocking: bool = False) -> int:
        """Move training states off the device until `reload_states()` (all kinds, or
        those in `include`), as an RLHF loop does around generation so that the inference
        engine gets the memory; returns the bytes moved off. Forward runs while only
        optimizer states, masters, gradients or buckets are away; anything that needs a
        moved state (backward, step, a checkpoint) refuses until the reload. States an
        offloaded optimizer keeps on the host already (`offload_optimizer`: masters and
        optimizer states; at stage 3 gradients too) stay where they are."""
        self._require_training("offload_states")
        if self.policies.zero.offload_param.enabled:
            raise ValueError("offload_states() with offload_param: the parameters already live in "
                             f"{self.policies.zero.offload_param.device} memory and are paged in by ZeRO itself; "
                             "moving states across devices is not supported for offloaded parameters")
        if not self.zero.reducer.sync_in_backward:
            raise RuntimeError("offload_states() inside engine.no_sync(): finish the block first")
        kinds = set(StateKind) if include is None else {StateKind(kind) for kind in include}
        if self.policies.zero.offload_optimizer.enabled:
            kinds -= {StateKind.MASTER_PARAMETERS, StateKind.OPTIMIZER_STATES}
            if self.policies.zero.partitions_parameters:
                kinds.discard(StateKind.GRADIENTS)
        self._drop_interrupted_pass()
        self.zero.release_gathered()  # stage 3: gathered parameters are rebuilt from the shards on use
        return self.parked.park(self._state_tensors, kinds, pin_memory=pin_memory, non_blocking=non_blocking,
                                device=self.device)

    def _state_tensors(self) -> dict[StateKind, list[torch.Tensor]]:
        by_kind = self.zero.state_tensors(self.module)
        if self.experts is not None:
            by_kind[StateKind.OPTIMIZER_STATES] += optimizer_state_tensors(self.experts.optimizer)
        return by_kind

    def reload_states(self, *, non_blocking: bool = False) -> None:
        """Bring back everything `offload_states()` moved, byte for byte."""
        self._require_alive("reload_states")
        self.parked.reload(non_blocking=non_blocking)

    @property
    def offloaded_states(self) -> frozenset[StateKind]:
        return frozenset(self.parked.kinds)

    def _require_states(self, call: str, needed: frozenset[StateKind]) -> None:
        if not self.parked.kinds:  # the usual case, on every forward, backward and step
            return
        away = needed & self.parked.kinds
        if away:
            names = ", ".join(sorted(kind.value for kind in away))
            raise RuntimeError(f"engine.{call}() needs states that offload_states() moved off ({names}): "
                               "call engine.reload_states() first")

    # -- accounting ----------------------------------------------------------------------
    def memory_breakdown(self, by_tier: bool = False) -> dict:
        """Bytes this rank held per category at that category's peak (docs/formulas.md#model-states-per-rank), on the
        training device; `by_tier=True`: {"device" | "host" | "nvme": {category: bytes}}."""
        return self.ledger.breakdown_by_tier() if by_tier else self.ledger.breakdown()

    def comm_volume(self, per_group: bool = False) -> dict:
        """Bytes this rank sent per collective since the last reset (ring model, docs/formulas.md#the-ring-model);
        `per_group=True`: {group purpose: {collective: bytes}}, plus "offload": bytes moved
        device -> host, host -> device, and read from / written to NVMe, and, when the job
        spans nodes, "intra_node" / "inter_node": the same bytes by the link they cross."""
        if not per_group:
            return self.comm_stats.totals()
        volume = {**self.comm_stats.by_group(), **self.comm_stats.by_link()}
        moved = {key: value - self._transfers_at_reset.get(key, 0) for key, value in self.zero.transfers().items()}
        if any(moved.values()):
            volume["offload"] = moved
        return volume

    def reset_comm_volume(self) -> None:
        self.comm_stats.clear()
        self._transfers_at_reset = self.zero.transfers()

    def num_parameters(self) -> int:
        return sum(unit.numel for unit in self.units)

    def persistent_numel(self) -> int:
        """Stage 3: elements kept whole on every rank (under the persistence threshold)."""
        return self.zero.params.persistent_numel()

    def padding_elements(self) -> int:
        return sum(unit.padded_numel - unit.numel for unit in self.units)

    # -- conveniences DeepSpeed users expect ---------------------------------------------
    def get_lr(self) -> list[float]:
        """Each param group's learning rate; [] for an engine without an optimizer, as DeepSpeed."""
        return [group["lr"] for group in self.optimizer.optimizer.param_groups] if self.trains else []

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # nn.Module's own: parameters, buffers, submodules
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__") or not hasattr(module, name):
                raise AttributeError(f"neither the engine nor its model has an attribute {name!r}") from None
        return getattr(module, name)

    def _require_alive(self, call: str) -> None:
        if self._destroyed:
            raise RuntimeError(f"engine.{call}() after engine.destroy(): this engine no longer trains "
                               "its model; build a new one with shardwise.initialize")

    def _require_training(self, call: str) -> None:
        self._require_alive(call)
        if not self.trains:
            raise RuntimeError(f"engine.{call}(): this engine was given no optimizer, so it only runs forward; "
                               "pass an optimizer to initialize() or add an 'optimizer' block to train")

    def destroy(self) -> None:
        """Detach from the model (hooks removed); the model can then get a new engine. An
        asynchronous save in progress is finished first (and its failure raised after), and
        the writer's process group destroyed. The mesh's groups stay: the model may still
        run on them, and later engines of the same layout share them (group_cache.py)."""
        try:
            self.wait_for_checkpoint()
        finally:
            if self._checkpoint_writer is not None:
                self._checkpoint_writer.close()
            self._detach()

    def _detach(self) -> None:
        self.parked.reload(non_blocking=False)  # the model keeps its weights (offload_states)
        if self.pass_failures is not None and watched_check() == self.pass_failures.check_blocked:
            watch_blocked_waits(None)
        if self.trains:
            self.zero.reducer.remove_hooks()
            self._output_backward.remove()
        self.zero.params.remove_hooks()
        self.zero.close()
        if self.zenflow is not None:
            self.zenflow.close()
        if self.experts is not None:
            self.experts.remove_hooks()
        for param in self.module.parameters():
            for attribute in ("_shardwise_zero", "_shardwise_hooks"):
                if hasattr(param, attribute):
                    delattr(param, attribute)
        self._destroyed = True


def _iterator(data_iter: Iterable[Any] | None, call: str) -> Iterator[Any]:
    if data_iter is None:
        raise ValueError(f"engine.{call}(data_iter=...) needs an iterator of micro-batches (shardwise has no "
                         "training data loader of its own)")
    return iter(data_iter)
