"""`deepspeed.runtime.pipe.schedule`: DeepSpeed's pipeline schedules as lists of instructions.

A schedule says, for one pipeline stage, what to do at each step of a batch: receive an
activation or a gradient, load a micro-batch, run a forward or a backward pass, send, and
at the end reduce gradients and step the optimizer. Code that drives its own pipeline
engine (Megatron-DeepSpeed's, custom schedules) iterates these. shardwise's pipeline
(runtime/parallel/pipeline/schedules.py) runs its own schedule; these classes give the same
instruction streams as DeepSpeed's for code that reads them.

Training is DeepSpeed's 1F1B timing on a clock of 2 * (micro_batches + stages - 1) steps:
stage s runs micro-batch m forward at step 2m + s and backward at step 2m + 2*stages - 1 - s,
so a stage alternates forward and backward steps, the last stage's backward follows its
forward at once, and each stage's backward comes one step after the next stage's. What a
step produced (an activation after a forward, a gradient after a backward) is sent at the
following step, where the neighbour needs it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterator

__all__ = [
    "BackwardPass", "BufferOpInstruction", "DataParallelSchedule", "ForwardPass", "InferenceSchedule",
    "LoadMicroBatch", "OptimizerStep", "PipeInstruction", "PipeSchedule", "RecvActivation", "RecvGrad",
    "ReduceGrads", "ReduceTiedGrads", "SendActivation", "SendGrad", "TrainSchedule",
]


class PipeInstruction:
    """One thing a stage does at a step; keyword arguments become attributes."""

    def __init__(self, **kwargs: Any):
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        arguments = ", ".join(f"{key}={value!r}" for key, value in self.kwargs.items())
        return f"{self.name}({arguments})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.kwargs == other.kwargs  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.kwargs.items()))))


class OptimizerStep(PipeInstruction):
    """Step the optimizer (the batch's last instruction)."""


class ReduceGrads(PipeInstruction):
    """Reduce gradients over the data-parallel group."""


class ReduceTiedGrads(PipeInstruction):
    """Reduce the gradients of weights tied across stages."""


class BufferOpInstruction(PipeInstruction):
    """An instruction on one of the stage's pipeline buffers (`buffer_id`)."""

    def __init__(self, buffer_id: int, **kwargs: Any):
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Load the next micro-batch into a buffer (first stage: inputs; last stage: labels)."""


class ForwardPass(BufferOpInstruction):
    """Run the stage's forward on a buffer."""


class BackwardPass(BufferOpInstruction):
    """Run the stage's backward on a buffer."""


class SendActivation(BufferOpInstruction):
    """Send a buffer's output activation to the next stage."""


class RecvActivation(BufferOpInstruction):
    """Receive the previous stage's activation into a buffer."""


class SendGrad(BufferOpInstruction):
    """Send the gradient of a buffer's input to the previous stage."""


class RecvGrad(BufferOpInstruction):
    """Receive the next stage's gradient of a buffer's output."""


class PipeSchedule(ABC):
    """The schedule of `stage_id` of a `stages`-deep pipeline for `micro_batches` micro-batches;
    iterating it yields one list of instructions per step."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int):
        if micro_batches < 1 or stages < 1 or not 0 <= stage_id < stages:
            raise ValueError(f"a pipeline schedule needs micro_batches >= 1, stages >= 1 and 0 <= stage_id < stages; "
                             f"got micro_batches={micro_batches}, stages={stages}, stage_id={stage_id}")
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1

    @abstractmethod
    def steps(self) -> Iterator[list[PipeInstruction]]:
        """One list of instructions per step of a batch."""

    def num_pipe_buffers(self) -> int:
        """How many micro-batches this stage holds at once."""
        return self.micro_batches

    def _valid_micro_batch(self, micro_batch_id: int | None) -> bool:
        return micro_batch_id is not None and 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    def _buffer_idx(self, micro_batch_id: int) -> int:
        return micro_batch_id % self.num_pipe_buffers()

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def _loads_data(self) -> bool:
        return self.is_first_stage or self.is_last_stage

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        return self.steps()


class InferenceSchedule(PipeSchedule):
    """Forward only: micro-batch m runs on stage s at step m + s, over micro_batches + stages - 1
    steps, with two buffers (one receiving while the other is sent)."""

    def num_pipe_buffers(self) -> int:
        return 2

    def steps(self) -> Iterator[list[PipeInstruction]]:
        previous: int | None = None
        for step in range(self.micro_batches + self.stages - 1):
            current = step - self.stage_id
            commands: list[PipeInstruction] = []
            if self._valid_micro_batch(current) and self._loads_data():
                commands.append(LoadMicroBatch(self._buffer_idx(current)))
            receive = ([RecvActivation(self._buffer_idx(current))]
                       if self._valid_micro_batch(current) and self._valid_stage(self.prev_stage) else [])
            send = ([SendActivation(self._buffer_idx(previous))]
                    if self._valid_micro_batch(previous) and self._valid_stage(self.next_stage) else [])
            # neighbours pair a send with a receive: even stages send first, odd stages receive first
            commands += send + receive if self.stage_id % 2 == 0 else receive + send
            if self._valid_micro_batch(current):
                commands.append(ForwardPass(self._buffer_idx(current)))
            previous = current
            yield commands


class TrainSchedule(PipeSchedule):
    """DeepSpeed's 1F1B training schedule (the module docstring gives its clock)."""

    def num_pipe_buffers(self) -> int:
        """Micro-batches in flight: a stage runs stages - stage_id forwards before its first
        backward frees a buffer (at least two, so a send and a receive can overlap)."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))

    def _micro_batch_at(self, step: int) -> tuple[int, bool]:
        """(micro-batch, is it a forward) at `step`; the micro-batch may be out of range."""
        if (step - self.stage_id) % 2 == 0:
            return (step - self.stage_id) // 2, True
        return (step - 2 * self.stages + 1 + self.stage_id) // 2, False

    def steps(self) -> Iterator[list[PipeInstruction]]:
        total = 2 * (self.micro_batches + self.stages - 1)
        previous: int | None = None
        for step in range(total):
            current, forward = self._micro_batch_at(step)
            commands: list[PipeInstruction] = []
            if forward:  # hand back the gradient of the last backward, then take the next activation
                if self._valid_micro_batch(previous) and self._valid_stage(self.prev_stage):
                    commands.append(SendGrad(self._buffer_idx(previous)))
                if self._valid_micro_batch(current) and self._valid_stage(self.prev_stage):
                    commands.append(RecvActivation(self._buffer_idx(current)))
            else:  # take the gradient for this backward, then pass on the last forward's activation
                if self._valid_micro_batch(current) and self._valid_stage(self.next_stage):
                    commands.append(RecvGrad(self._buffer_idx(current)))
                if self._valid_micro_batch(previous) and self._valid_stage(self.next_stage):
                    commands.append(SendActivation(self._buffer_idx(previous)))
            if self._valid_micro_batch(current):
                if forward and self._loads_data():
                    commands.append(LoadMicroBatch(self._buffer_idx(current)))
                commands.append((ForwardPass if forward else BackwardPass)(self._buffer_idx(current)))
            if step == total - 1:
                commands += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            previous = current
            yield commands


class DataParallelSchedule(PipeSchedule):
    """No pipeline: each micro-batch loaded, forward, backward; then reduce and step."""

    def num_pipe_buffers(self) -> int:
        return 1

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for micro_batch in range(self.micro_batches):
            commands: list[PipeInstruction] = [LoadMicroBatch(0), ForwardPass(0), BackwardPass(0)]
            if micro_batch == self.micro_batches - 1:
                commands += [ReduceGrads(), OptimizerStep()]
            yield commands
