"""Running one global batch through the pipeline schedule on top of the ZeRO engine.

Why our own schedule and not `torch.distributed.pipelining`: its stages run backward
themselves and scale, accumulate and (with DDP/FSDP) reduce gradients their own way,
while ZeRO's gradient reducer must bracket every backward (begin/end: which units to
reduce, whether this backward ends the accumulation window) and own the loss scale. Here
each backward pass of the schedule is one ZeRO backward, exactly like one micro-batch of
gradient accumulation in the plain engine:

    last stage    backward of loss * scale / m      (the engine's own scaling)
    other stages  backward of the stage output with the gradient received from the next
                  stage (already scaled), so no stage rescales

At stages 0-1 gradients accumulate in the full buffer and are reduced over the
data-parallel group in the rank's last backward; at stage 2 every backward
reduce-scatters its micro-batch's gradient into the partition. One optimizer step per
global batch follows (engine.step), after the squared gradient norms of all stages are
summed (stages hold different parameters), so clipping and overflow skips agree
everywhere. The runner drives the engine through its protocol (runtime/engine_protocol.py):
each backward is `engine.backward_with_gradients`, the batch's step
`engine.step_after_schedule`.

Each micro-batch's loss exists on the last stage only: `run` averages it over the
micro-batches and the data-parallel group and broadcasts it over the pipeline group.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Iterator

import torch
from torch import nn

from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.engine_protocol import EngineProtocol
from shardwise.runtime.parallel.pipeline.adapter import Adapter, StageContext
from shardwise.runtime.parallel.pipeline.p2p import (
    Expect,
    PipelineChannel,
    PipelineError,
    Shapes,
    message_tensors,
)
from shardwise.runtime.parallel.pipeline.plan import Message, MessagePlan
from shardwise.runtime.parallel.pipeline.schedules import Action, schedule_actions, timeline
from shardwise.runtime.parallel.pipeline.shared import SharedExchange
from shardwise.runtime.parallel.pipeline.split import StageLayout
from shardwise.runtime.precision.casting import cast_floating, to_device


class PipelineRunner:
    def __init__(self, engine: EngineProtocol, *, adapter: Adapter, layout: StageLayout, schedule: str,
                 micro_batches: int):
        self.engine = engine
        self.model: nn.Module = engine.module
        self.adapter = adapter
        self.layout = layout
        self.schedule = schedule
        self.micro_batches = micro_batches
        mesh, stats = engine.mesh, engine.comm_stats
        self.channel = PipelineChannel(mesh["pipeline"], stats, engine.device, engine.context.timeout)
        self.pipeline = Communicator(mesh["pipeline"], stats)
        self.data = Communicator(mesh["data"], stats)
        self.layers = {index: self.model.get_submodule(layout.paths[index])
                       for chunk in layout.chunks for index in chunk}  # this rank's, by index
        self.tied = layout.tied
        self.tied_leaf: torch.Tensor | None = None
        self.shared = SharedExchange(self.model, layout.shared, layout.rank) if layout.shared else None
        self.plans: dict[bool, MessagePlan] = {}  # by train (a schedule) or not (forwards only)
        self.last_timing: dict[str, float] = {}  # total_s, busy_s and bubble (idle share) of the last batch
        self.synced_at = 0.0
        self.peak_in_flight = 0  # micro-batches whose activations were held at once, last batch
        self.peak_activation_bytes = 0  # bytes autograd saved for those, at their peak, last batch
        self.held_bytes: dict[tuple[int, int], int] = {}

    # -- the engine's hooks -----------------------------------------------------------------
    def combine_norm(self, norm_squared: torch.Tensor) -> torch.Tensor:
        """Each stage's squared gradient norm -> the whole model's (stages hold disjoint parameters)."""
        total = norm_squared.float().reshape(1)
        self.pipeline.control_all_reduce(total, "squared gradient norm over the pipeline group")
        self.synced_at = time.perf_counter()  # every stage is here: the step's schedule ends for all
        return total[0]

    # -- one batch ----------------------------------------------------------------------------
    def run(self, data_iter: Iterator[Any], loss_fn: Callable[..., torch.Tensor] | None, train: bool) -> torch.Tensor:
        """The mean loss of one global batch (on every rank); with `train`, one optimizer
        step (the engine has checked that no accumulation window is open)."""
        contexts = [self._context(micro_batch) for micro_batch in take_micro_batches(data_iter, self.micro_batches)]
        plan = self._plan(train)
        losses: dict[int, torch.Tensor] = {}
        self.stash: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.busy = 0.0
        self.peak_in_flight = 0
        self.peak_activation_bytes = 0
        self.held_bytes = {}
        self.parameter_storage = {param.untyped_storage().data_ptr() for param in self.model.parameters()}
        was_training = self.model.training
        self.model.train(train and was_training)  # eval_batch runs in eval mode, as DeepSpeed's does
        started = time.perf_counter()
        expect = functools.partial(self._expect, contexts=contexts)
        try:
            self.channel.connect()
            self._exchange_weights(plan, expect)
            final_backward = max((k for k, a in enumerate(plan.mine) if a is not None and a.kind == "backward"),
                                 default=-1)
            for step, action in enumerate(plan.mine):
                if action is not None:
                    self._do(action, contexts, losses, loss_fn, train, step == final_backward)
                self.channel.exchange(plan.at(step), expect)
            self.channel.finish()
        except BaseException:
            self.channel.abandon()
            self.stash.clear()
            raise
        finally:
            self.model.train(was_training)
        self.synced_at = time.perf_counter()
        if train:
            self.engine.step_after_schedule(self.micro_batches)
        total = self.synced_at - started
        self.last_timing = {"total_s": total, "busy_s": self.busy, "bubble": 1 - self.busy / total}
        return self._mean_loss(losses)

    def _plan(self, train: bool) -> MessagePlan:
        """Every rank's passes on common steps, and this rank's messages at each (the
        same for every batch)."""
        if train in self.plans:
            return self.plans[train]
        layout, m = self.layout, self.micro_batches
        if train:
            queues = [schedule_actions(self.schedule, rank, layout.size, m, layout.virtual)
                      for rank in range(layout.size)]
        else:
            forwards = [Action("forward", chunk, i) for i in range(m) for chunk in range(layout.virtual)]
            queues = [forwards] * layout.size
        self.plans[train] = MessagePlan(timeline(queues, layout.virtual), layout.rank, layout.virtual, m, self.tied,
                                        layout.shared)
        return self.plans[train]

    def _expect(self, message: Message, contexts: list[StageContext]) -> Shapes | None:
        """(shape, dtype) of every tensor of a message this rank receives; None for an
        activation whose shape only a header can tell."""
        engine, layout = self.engine, self.layout
        if message.kind == "activation":
            shape = self.adapter.activation_shape(self.model, contexts[message.micro_batch])
            return None if shape is None else [(tuple(shape), engine.dtype)]
        if message.kind == "gradient":  # one per floating tensor this stage sent forward
            _, output = self.stash[(message.target // layout.size, message.micro_batch)]
            return [(tuple(tensor.shape), tensor.dtype) for tensor in message_tensors(output)
                    if tensor.is_floating_point()]
        if message.kind == "tied weight":
            return [(tuple(layout.tied_shape), engine.dtype)]
        if message.kind == "tied gradient":
            weight = self.model.get_submodule(self.adapter.embedding_path).weight
            return [(tuple(weight.shape), weight.dtype)]
        return self.shared.expect(message, engine.dtype)

    def _context(self, micro_batch: Any) -> StageContext:
        """A dict of forward keyword arguments, or (inputs, labels) as PipelineModule takes."""
        if isinstance(micro_batch, dict):
            kwargs, labels = dict(micro_batch), None
        elif isinstance(micro_batch, (tuple, list)) and len(micro_batch) == 2:
            kwargs, labels = {self.adapter.input_name: micro_batch[0]}, micro_batch[1]
        else:
            raise TypeError(f"a pipeline micro-batch is a dict of forward keyword arguments or an (inputs, labels) "
                            f"pair; next(data_iter) gave {type(micro_batch).__name__}")
        device, dtype = self.engine.device, self.engine.dtype
        kwargs, labels = cast_floating((kwargs, labels), dtype)
        kwargs = {key: to_device(value, device) for key, value in kwargs.items()}
        labels = to_device(labels, device)
        context = StageContext(kwargs, labels, {})
        if self.adapter.input_name not in kwargs:
            raise ValueError(f"a pipeline micro-batch needs `{self.adapter.input_name}`: every stage reads its shape")
        self.adapter.prepare(self.model, context, dtype)
        return context

    def _exchange_weights(self, plan: MessagePlan, expect: Expect) -> None:
        """The first stage's current embedding weight becomes the last stage's output weight,
        and the owners' values of shared layers' parameters replace the other stages' (shared.py)."""
        layout = self.layout
        if self.shared is not None:
            self.shared.post_values(self.channel)
        if self.tied and layout.first:
            weight = self.model.get_submodule(self.adapter.embedding_path).weight
            self.channel.post(Message("tied weight", 0, layout.last_stage), weight)
        self.channel.exchange(plan.prologue(), expect)
        if self.shared is not None:
            for leaf in self.shared.take_values(self.channel):
                self.parameter_storage.add(leaf.untyped_storage().data_ptr())
        if self.tied and layout.last:
            leaf = self.channel.take(Message("tied weight", 0, layout.last_stage))[0].requires_grad_()
            self.model.get_submodule(self.adapter.head_path).weight = leaf
            self.tied_leaf = leaf
            self.parameter_storage.add(leaf.untyped_storage().data_ptr())  # a weight, not an activation

    def _do(self, action: Action, contexts: list[StageContext], losses: dict[int, torch.Tensor],
            loss_fn: Callable[..., torch.Tensor] | None, train: bool, final_backward: bool) -> None:
        stage = self.layout.stage(action.chunk)
        try:
            if action.kind == "forward":
                with torch.enable_grad() if train else torch.no_grad():
                    self._forward(action, stage, contexts[action.micro_batch], losses, loss_fn, train)
            else:
                self._backward(action, stage, final_backward)
        except PipelineError:
            raise
        except BaseException as error:
            raise PipelineError(f"rank {self.channel.me}: stage {stage}, micro-batch {action.micro_batch}: "
                                f"{action.kind} raised {type(error).__name__}: {error}") from error

    def _forward(self, action: Action, stage: int, context: StageContext, losses: dict[int, torch.Tensor],
                 loss_fn: Callable[..., torch.Tensor] | None, train: bool) -> None:
        i = action.micro_batch
        received = None
        if stage == 0:
            begin = time.perf_counter()
            hidden = self.adapter.embed(self.model, context)
        else:
            received = self.channel.take_output(Message("activation", stage - 1, stage, i))
            begin = time.perf_counter()
            for tensor in message_tensors(received):
                tensor.requires_grad_(train and tensor.is_floating_point())
            hidden = received
        saved: dict[int, int] = {}  # storage -> bytes autograd keeps for backward (weights excluded)
        with torch.autograd.graph.saved_tensors_hooks(lambda tensor: _count_saved(tensor, saved,
                                                                                  self.parameter_storage),
                                                      lambda tensor: tensor):
            hidden = self.adapter.run_layers([self.layers[index] for index in self.layout.chunks[action.chunk]],
                                             hidden, context)
            if stage == self.layout.last_stage:
                hidden = self.adapter.loss(self.model, hidden, context, loss_fn)
                losses[i] = hidden.detach().float()
        self.busy += time.perf_counter() - begin
        if stage != self.layout.last_stage:
            described = self.adapter.activation_shape(self.model, context) is None
            self.channel.post(Message("activation", stage, stage + 1, i), hidden, described)
        if train:
            self.stash[(action.chunk, i)] = (received, hidden)
            self.held_bytes[(action.chunk, i)] = sum(saved.values())
            self.peak_in_flight = max(self.peak_in_flight, len(self.stash))
            self.peak_activation_bytes = max(self.peak_activation_bytes, sum(self.held_bytes.values()))

    def _backward(self, action: Action, stage: int, final_backward: bool) -> None:
        i = action.micro_batch
        engine, layout = self.engine, self.layout
        received, output = self.stash.pop((action.chunk, i))
        self.held_bytes.pop((action.chunk, i))
        if stage == layout.last_stage:
            tensors = [output.float() * (engine.loss_scaler.scale / engine.gradient_accumulation_steps)]
            grads: list[torch.Tensor | None] = [None]
            loss = output.detach()
        else:  # a gradient for every floating tensor sent; those that carry no graph here take none
            floating = [tensor for tensor in message_tensors(output) if tensor.is_floating_point()]
            received_grads = self.channel.take(Message("gradient", stage + 1, stage, i))
            tensors = [tensor for tensor in floating if tensor.requires_grad]
            grads = [grad for tensor, grad in zip(floating, received_grads) if tensor.requires_grad]
            loss = torch.zeros(())
        if stage == 0 and final_backward and self.tied:
            weight = self.model.get_submodule(self.adapter.embedding_path).weight
            tensors.append(weight)
            grads.append(self.channel.take(Message("tied gradient", layout.last_stage, 0))[0])
        if final_backward and self.shared is not None:  # what the other stages' uses of owned layers gave
            params, shared_grads = self.shared.take_gradients(self.channel)
            tensors += params
            grads += shared_grads
        begin = time.perf_counter()
        engine.backward_with_gradients(tensors, grads, boundary=final_backward, loss=loss)
        self.busy += time.perf_counter() - begin
        if stage > 0:
            floating = [tensor for tensor in message_tensors(received) if tensor.is_floating_point()]
            self.channel.post(Message("gradient", stage, stage - 1, i),
                              [tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
                               for tensor in floating])
        if stage == layout.last_stage and self.tied and i == self.micro_batches - 1:
            self.channel.post(Message("tied gradient", stage, 0), self.tied_leaf.grad)
        if self.shared is not None and i == self.micro_batches - 1:
            self.shared.post_gradients(self.channel)

    def _mean_loss(self, losses: dict[int, torch.Tensor]) -> torch.Tensor:
        """Mean over micro-batches and data-parallel ranks, on every rank of the pipeline."""
        total = torch.zeros(1, dtype=torch.float64)
        if self.layout.last:
            total += torch.stack([losses[i].cpu() for i in range(self.micro_batches)]).double().sum()
            self.data.control_all_reduce(total, "the batch's loss over the data-parallel group")
            total /= self.micro_batches * self.data.size
        self.pipeline.control_all_reduce(total, "the batch's loss from the last stage")
        return total[0].float()


def take_micro_batches(data_iter: Iterator[Any], count: int) -> list[Any]:
    """One batch's `count` micro-batches, all taken before any runs: an iterator that
    runs out is named here, rather than as a bare StopIteration (which a caller's `for`
    loop would take for its own end) after part of an accumulation window was trained."""
    micro_batches = []
    for _ in range(count):
        try:
            micro_batches.append(next(data_iter))
        except StopIteration:
            raise ValueError(
                f"the data iterator ran out after {len(micro_batches)} micro-batch(es), but one batch runs {count} "
                "(pipeline_parallel.micro_batches, default gradient_accumulation_steps): give an iterator with at "
                "least that many, e.g. wrap a finite loader in deepspeed.utils.RepeatingLoader"
            ) from None
    return micro_batches


def _count_saved(tensor: torch.Tensor, saved: dict[int, int], parameter_storage: set[int]) -> torch.Tensor:
    """A saved-tensor pack hook that only measures: bytes per storage, parameters left out."""
    storage = tensor.untyped_storage()
    if storage.data_ptr() not in parameter_storage:
        saved[storage.data_ptr()] = storage.nbytes()
    return tensor
