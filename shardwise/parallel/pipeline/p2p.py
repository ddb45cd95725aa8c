"""Point-to-point messages between pipeline stages: activations forward, gradients back,
and the tied embedding's weight and gradient between the first and last stage.

Every message goes over the pipeline group's data process group with a tag made of the
virtual stage, micro-batch and kind, so messages that travel between the same two ranks
(interleaved chunks, the tied weight) can never be confused. Sends are asynchronous and
finished at the end of the batch; receives block, so an error names what this rank was
waiting for: its stage, the micro-batch, the message and the peer. Bytes are counted in
the engine's statistics under ("pipeline", "send"), so `comm_volume(per_group=True)`
shows them beside the ZeRO collectives (receives are the peer's sends, not counted twice).
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from shardwise.distributed.collectives import CommStats
from shardwise.distributed.mesh import GroupHandle

KINDS = ("activation", "gradient", "tied weight", "tied gradient", "activation header")
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


class PipelineChannel:
    def __init__(self, handle: GroupHandle, stats: CommStats, virtual: int, micro_batches: int,
                 timeout: datetime.timedelta):
        self.handle = handle
        self.stats = stats
        self.virtual = virtual
        self.micro_batches = micro_batches
        self.timeout = timeout
        self.sent: list[tuple[str, dist.Work, torch.Tensor]] = []  # what, handle, the tensor kept alive

    def _tag(self, kind: str, stage: int, micro_batch: int, part: int) -> int:
        stages = self.handle.size * self.virtual
        return ((KINDS.index(kind) * stages + stage) * self.micro_batches + micro_batch) * MAX_PARTS + part + 1

    def _peer(self, stage: int) -> int:
        """Global rank that holds virtual stage `stage`."""
        return self.handle.ranks[stage % self.handle.size]

    def send(self, tensor: torch.Tensor, kind: str, to_stage: int, from_stage: int, micro_batch: int,
             part: int = 0) -> None:
        """Start sending `tensor` (kept alive until `finish_sends`) to the rank of `to_stage`."""
        tensor = tensor.detach().contiguous()
        peer = self._peer(to_stage)
        what = f"send of the {kind} of micro-batch {micro_batch} to stage {to_stage} (rank {peer})"
        try:
            tag = self._tag(kind, from_stage, micro_batch, part)
            work = dist.isend(tensor, peer, group=self.handle.group, tag=tag)
        except Exception as error:
            raise PipelineError(f"rank {self.me}: stage {from_stage}: {what} failed: {error}") from error
        self.stats.volume[(self.handle.purpose, "send")] += tensor.numel() * tensor.element_size()
        self.sent.append((what, work, tensor))

    def receive(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device, kind: str,
                from_stage: int, to_stage: int, micro_batch: int, part: int = 0) -> torch.Tensor:
        """Block until the `kind` of `micro_batch` from `from_stage`'s rank has arrived."""
        buffer = torch.empty(shape, dtype=dtype, device=device)
        peer = self._peer(from_stage)
        started = time.monotonic()
        try:
            tag = self._tag(kind, from_stage, micro_batch, part)
            work = dist.irecv(buffer, peer, group=self.handle.group, tag=tag)
            if work.wait(self.timeout) is False:
                raise RuntimeError(f"nothing arrived within {self.timeout.total_seconds():g}s")
        except Exception as error:
            raise PipelineError(
                f"rank {self.me}: stage {to_stage}, micro-batch {micro_batch}: receive of the {kind} from stage "
                f"{from_stage} (rank {peer}) failed after {time.monotonic() - started:.1f}s: {error}. The other "
                "stage raised or stopped; its own error names the pass that failed"
            ) from error
        return buffer

    def send_output(self, value: torch.Tensor | tuple, to_stage: int, from_stage: int, micro_batch: int,
                    described: bool) -> None:
        """A stage output (a tensor or a tuple of them); `described`: preceded by a header
        of its shapes and dtypes, for a receiver that cannot derive them."""
        if described:
            self.send(encode_header(value), "activation header", to_stage, from_stage, micro_batch)
        for part, tensor in enumerate(message_tensors(value)):
            self.send(tensor, "activation", to_stage, from_stage, micro_batch, part)

    def receive_output(self, device: torch.device, from_stage: int, to_stage: int, micro_batch: int,
                       known: tuple[tuple[int, ...], torch.dtype] | None) -> torch.Tensor | tuple:
        """The previous stage's output: one tensor of the `known` (shape, dtype), or what
        its header describes."""
        if known is not None:
            return self.receive(known[0], known[1], device, "activation", from_stage, to_stage, micro_batch)
        header = self.receive((HEADER_LENGTH,), torch.int64, device, "activation header", from_stage, to_stage,
                              micro_batch)
        is_tuple, parts = decode_header(header.cpu())
        tensors = tuple(self.receive(shape, dtype, device, "activation", from_stage, to_stage, micro_batch, part)
                        for part, (shape, dtype) in enumerate(parts))
        return tensors if is_tuple else tensors[0]

    def finish_sends(self) -> None:
        """Wait for every send of the batch (the receivers have taken them by then)."""
        sent, self.sent = self.sent, []
        for what, work, _ in sent:
            try:
                if work.wait(self.timeout) is False:
                    raise RuntimeError(f"not taken within {self.timeout.total_seconds():g}s")
            except Exception as error:
                raise PipelineError(f"rank {self.me}: {what} failed: {error}") from error

    def abandon_sends(self) -> None:
        """After an error: drop the handles (the process group reports or times them out)."""
        self.sent = []

    @property
    def me(self) -> int:
        """This process's global rank."""
        return self.handle.ranks[self.handle.rank]
