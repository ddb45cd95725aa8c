"""Point-to-point messages between pipeline stages: activations forward, gradients back,
and tied or shared weights and their gradients (plan.py lists which, at which step).

A rank's messages of one step are started in one batch of `dist.batch_isend_irecv`, its
sends and receives in the plan's order, which is the same on both ends of every message:
messages between the same two ranks are told apart by their order, never by a tag (NCCL
has none), and a send and a receive between two neighbours can never block each other.
No operation is waited for in the exchange: a pass waits on the works of the message it
takes, and sends are let go once done, or waited for at the end of the batch. On CUDA a
wait orders the current stream after the transfer and returns at once (the host goes on
queueing work; the process group's watchdog enforces the timeout); on gloo it blocks, at
most the timeout, so an error names what this rank was waiting for: its stage, the
micro-batch, the message and the peer.

An activation whose shape the receiver cannot derive (the layers' outputs of a list of
layers) is preceded by a header of shapes and dtypes: a tensor on the pipeline's device
(NCCL moves only CUDA tensors), exchanged in a batch of its own just before the step's
messages, so the receiver can allocate them. Bytes sent are counted in the engine's
statistics under ("pipeline", "send"), so `comm_volume(per_group=True)` shows them beside
the ZeRO collectives (receives are the peer's sends, not counted twice).
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from shardwise.runtime.distributed.collectives import CommStats
from shardwise.runtime.distributed.mesh import GroupHandle
from shardwise.runtime.distributed.retired_works import retire
from shardwise.runtime.parallel.pipeline.plan import Message

MAX_PARTS = 16  # tensors in one message (a stage output that is a tuple of tensors)
HEADER_LENGTH = 64
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)


def message_tensors(value: torch.Tensor | tuple | list) -> list[torch.Tensor]:
    """The tensors of a stage output: a tensor, or a tuple of tensors (as DeepSpeed's
    PipelineModule layers pass them)."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)) and all(torch.is_tensor(item) for item in value) and 0 < len(value) <= MAX_PARTS:
        return list(value)
    raise TypeError(f"a pipeline stage's output must be a tensor or a tuple of 1-{MAX_PARTS} tensors, "
                    f"got {type(value).__name__}")


def encode_header(value: torch.Tensor | tuple | list) -> torch.Tensor:
    """Shapes and dtypes of a stage output, for a receiver that cannot derive them: [0 for
    a bare tensor or the tuple's length, then per tensor its dtype code, rank and sizes]."""
    tensors = message_tensors(value)
    entries = [0 if torch.is_tensor(value) else len(tensors)]
    for tensor in tensors:
        if tensor.dtype not in DTYPES:
            raise TypeError(f"a pipeline stage's output of dtype {tensor.dtype} cannot be sent; use one of {DTYPES}")
        entries += [DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
    if len(entries) > HEADER_LENGTH:
        raise ValueError(f"a pipeline stage's output has too many dimensions to describe ({len(entries)} numbers, "
                         f"at most {HEADER_LENGTH})")
    return torch.tensor(entries + [0] * (HEADER_LENGTH - len(entries)), dtype=torch.int64)


def decode_header(header: torch.Tensor) -> tuple[bool, list[tuple[tuple[int, ...], torch.dtype]]]:
    """(whether the output is a tuple, [(shape, dtype) per tensor]) from `encode_header`."""
    entries = header.tolist()
    count, position, parts = entries[0], 1, []
    for _ in range(max(count, 1)):
        dtype, rank = DTYPES[entries[position]], entries[position + 1]
        parts.append((tuple(entries[position + 2 : position + 2 + rank]), dtype))
        position += 2 + rank
    return count > 0, parts


class PipelineError(RuntimeError):
    """A pass or message of the pipeline schedule failed; names stage, micro-batch and operation."""


Shapes = list[tuple[tuple[int, ...], torch.dtype]]  # (shape, dtype) of each tensor of a message
Expect = Callable[[Message], "Shapes | None"]


@dataclass
class _Outgoing:
    tensors: list[torch.Tensor]
    header: torch.Tensor | None  # shapes and dtypes, for a receiver that cannot derive them


@dataclass
class _Operation:
    message: Message
    sends: bool
    tensor: torch.Tensor
    peer: int  # global rank
    what: str  # the kind, or "activation header"


@dataclass
class _Issued:
    """Operations of one message (or one header) and the works that finish them: one per
    operation on gloo, the whole batch's on NCCL (it coalesces a batch into one work)."""

    operations: list[_Operation]
    works: list[dist.Work]


@dataclass
class _Received:
    issued: _Issued
    is_tuple: bool  # the sender's value was a tuple (known only from a header)


class PipelineChannel:
    def __init__(self, handle: GroupHandle, stats: CommStats, device: torch.device, timeout: datetime.timedelta):
        self.handle = handle
        self.stats = stats
        self.device = device
        self.timeout = timeout
        self.outbox: dict[Message, _Outgoing] = {}
        self.inbox: dict[Message, _Received] = {}
        self.sending: list[_Issued] = []  # sends in flight (their tensors kept alive until done)
        self.connected = handle.size == 1

    def connect(self) -> None:
        """Once, on every rank of the pipeline group together: a batched exchange that is a
        group's first collective must include all its ranks (torch's batch_isend_irecv
        note: NCCL creates the group's communicator then), and most of ours include two."""
        if not self.connected:
            first = torch.zeros(1, device=self.device)
            work = dist.all_reduce(first, group=self.handle.group, async_op=True)
            work.wait()
            retire(work, first)
            self.connected = True

    def post(self, message: Message, value: torch.Tensor | tuple | list, described: bool = False) -> None:
        """`value` goes out in the exchange that lists `message`: a stage output (a tensor
        or a tuple of them), or a list of tensors (gradients; may be empty); `described`:
        preceded by a header of its shapes and dtypes."""
        parts = value if isinstance(value, list) else message_tensors(value)
        tensors = [tensor.detach().contiguous() for tensor in parts]
        header = encode_header(value).to(self.device) if described else None
        self.outbox[message] = _Outgoing(tensors, header)

    def take(self, message: Message) -> list[torch.Tensor]:
        """The tensors of a message an earlier exchange started receiving, once arrived
        (the wait for a message happens here, when a pass needs it, not in the exchange)."""
        return [op.tensor for op in self._take(message).issued.operations]

    def take_output(self, message: Message) -> torch.Tensor | tuple:
        """A stage output as its sender had it: one tensor, or a tuple (said by a header)."""
        received = self._take(message)
        tensors = [op.tensor for op in received.issued.operations]
        return tuple(tensors) if received.is_tuple else tensors[0]

    def _take(self, message: Message) -> _Received:
        if message not in self.inbox:
            raise PipelineError(f"rank {self.me}: the {message.kind} of micro-batch {message.micro_batch} from stage "
                                f"{message.source} was never received: the pipeline plan and the passes disagree")
        received = self.inbox.pop(message)
        self._wait(received.issued)
        return received

    def exchange(self, messages: list[Message], expect: Expect) -> None:
        """Start sending what was posted for `messages` and receiving the rest, in their
        order, as one batch. `expect(message)`: the (shape, dtype) of each tensor a
        received message carries, or None when a header describes them (headers go first,
        in a batch of their own that this rank waits for: it needs the shapes)."""
        if not messages:
            return
        self._forget_finished_sends()
        sending = [message for message in messages if self._sends(message)]
        missing = [message for message in sending if message not in self.outbox]
        if missing:
            raise PipelineError(f"rank {self.me}: {missing[0]} is due now but its pass did not produce it: the "
                                "pipeline plan and the passes disagree")
        expected = {message: expect(message) for message in messages if not self._sends(message)}
        headers: dict[Message, torch.Tensor] = {}
        for message in messages:
            if message in expected and expected[message] is None:
                headers[message] = torch.empty(HEADER_LENGTH, dtype=torch.int64, device=self.device)
            elif message in self.outbox and self.outbox[message].header is not None:
                headers[message] = self.outbox[message].header
        described: dict[Message, tuple[bool, list]] = {}
        if headers:
            issued = self._start({message: [self._operation(message, header, "activation header")]
                                  for message, header in headers.items()})
            for message in headers:
                if message in expected:
                    self._wait(issued[message])
                    described[message] = decode_header(headers[message].cpu())
                else:
                    self.sending.append(issued[message])
        operations: dict[Message, list[_Operation]] = {}
        for message in messages:
            if message in self.outbox:
                operations[message] = [self._operation(message, tensor) for tensor in self.outbox.pop(message).tensors]
                continue
            is_tuple, parts = described.get(message, (False, expected[message]))
            operations[message] = [self._operation(message, torch.empty(shape, dtype=dtype, device=self.device))
                                   for shape, dtype in parts]
        for message, issued in self._start(operations).items():
            if message in expected:
                self.inbox[message] = _Received(issued, described.get(message, (False,))[0])
            else:
                self.sending.append(issued)

    def finish(self) -> None:
        """The batch is over: wait for the sends still in flight; every message posted must
        have gone out and every one received must have been used."""
        left = sorted(self.outbox, key=Message.order) + sorted(self.inbox, key=Message.order)
        if left:
            self.abandon()
            raise PipelineError(f"rank {self.me}: {left[0]} was left over at the end of the batch: the pipeline plan "
                                "and the passes disagree")
        sending, self.sending = self.sending, []
        for issued in sending:
            self._wait(issued)

    def abandon(self) -> None:
        """After an error: drop what was posted, received or in flight (the process group
        reports or times out what its peers never matched)."""
        self.outbox.clear()
        self.inbox.clear()
        self.sending.clear()

    def _sends(self, message: Message) -> bool:
        return self._rank_of(message.source) == self.me

    def _rank_of(self, stage: int) -> int:
        """Global rank that holds virtual stage `stage`."""
        return self.handle.ranks[stage % self.handle.size]

    def _operation(self, message: Message, tensor: torch.Tensor, what: str | None = None) -> _Operation:
        sends = self._sends(message)
        peer = self._rank_of(message.target if sends else message.source)
        return _Operation(message, sends, tensor, peer, what or message.kind)

    def _start(self, operations: dict[Message, list[_Operation]]) -> dict[Message, _Issued]:
        """Issue one batch: every operation of every message, in the messages' order."""
        flat = [op for ops in operations.values() for op in ops]
        if not flat:
            return {message: _Issued(ops, []) for message, ops in operations.items()}
        batch = [dist.P2POp(dist.isend if op.sends else dist.irecv, op.tensor, op.peer, self.handle.group)
                 for op in flat]
        try:
            works = dist.batch_isend_irecv(batch)
        except Exception as error:
            raise PipelineError(f"rank {self.me}: starting the exchange of {self._list(flat)} failed: "
                                f"{error}") from error
        for op in flat:
            if op.sends:
                self.stats.volume[(self.handle.purpose, "send")] += op.tensor.numel() * op.tensor.element_size()
        issued, position = {}, 0
        for message, ops in operations.items():
            if len(works) == len(flat):  # gloo: one work per operation
                issued[message] = _Issued(ops, works[position : position + len(ops)])
            else:  # NCCL: the coalesced batch's work finishes every operation in it
                issued[message] = _Issued(ops, list(works))
            position += len(ops)
        return issued

    def _wait(self, issued: _Issued) -> None:
        """On CUDA the wait orders the current stream after the transfer and returns at once;
        on gloo it blocks, at most the timeout."""
        started = time.monotonic()
        for work in issued.works:
            try:
                if self.device.type == "cuda":
                    work.wait()
                elif work.wait(self.timeout) is False:
                    raise RuntimeError(f"not done within {self.timeout.total_seconds():g}s")
            except Exception as error:
                raise PipelineError(self._failure(issued.operations[0], error, time.monotonic() - started)) from error

    def _forget_finished_sends(self) -> None:
        """Let go of the tensors of sends that are done (checked without waiting), so a
        batch holds the activations still in flight, not all it sent."""
        self.sending = [issued for issued in self.sending if not all(work.is_completed() for work in issued.works)]

    def _failure(self, op: _Operation, error: Exception, waited: float) -> str:
        message = op.message
        if op.sends:
            return (f"rank {self.me}: stage {message.source}: send of the {op.what} of micro-batch "
                    f"{message.micro_batch} to stage {message.target} (rank {op.peer}) failed: {error}")
        return (f"rank {self.me}: stage {message.target}, micro-batch {message.micro_batch}: receive of the {op.what} "
                f"from stage {message.source} (rank {op.peer}) failed after {waited:.1f}s: {error}. The other stage "
                "raised or stopped; its own error names the pass that failed")

    @staticmethod
    def _list(operations: list[_Operation]) -> str:
        return ", ".join(f"{'send' if op.sends else 'receive'} of the {op.what} of micro-batch "
                         f"{op.message.micro_batch} {'to' if op.sends else 'from'} rank {op.peer}"
                         for op in operations)

    @property
    def me(self) -> int:
        """This process's global rank."""
        return self.handle.ranks[self.handle.rank]
