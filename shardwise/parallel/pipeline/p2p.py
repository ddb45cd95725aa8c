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

KINDS = ("activation", "gradient", "tied weight", "tied gradient")


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

    def _tag(self, kind: str, stage: int, micro_batch: int) -> int:
        stages = self.handle.size * self.virtual
        return (KINDS.index(kind) * stages + stage) * self.micro_batches + micro_batch + 1

    def _peer(self, stage: int) -> int:
        """Global rank that holds virtual stage `stage`."""
        return self.handle.ranks[stage % self.handle.size]

    def send(self, tensor: torch.Tensor, kind: str, to_stage: int, from_stage: int, micro_batch: int) -> None:
        """Start sending `tensor` (kept alive until `finish_sends`) to the rank of `to_stage`."""
        tensor = tensor.detach().contiguous()
        peer = self._peer(to_stage)
        what = f"send of the {kind} of micro-batch {micro_batch} to stage {to_stage} (rank {peer})"
        try:
            work = dist.isend(tensor, peer, group=self.handle.group, tag=self._tag(kind, from_stage, micro_batch))
        except Exception as error:
            raise PipelineError(f"rank {self.me}: stage {from_stage}: {what} failed: {error}") from error
        self.stats.volume[(self.handle.purpose, "send")] += tensor.numel() * tensor.element_size()
        self.sent.append((what, work, tensor))

    def receive(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device, kind: str,
                from_stage: int, to_stage: int, micro_batch: int) -> torch.Tensor:
        """Block until the `kind` of `micro_batch` from `from_stage`'s rank has arrived."""
        buffer = torch.empty(shape, dtype=dtype, device=device)
        peer = self._peer(from_stage)
        started = time.monotonic()
        try:
            work = dist.irecv(buffer, peer, group=self.handle.group, tag=self._tag(kind, from_stage, micro_batch))
            if work.wait(self.timeout) is False:
                raise RuntimeError(f"nothing arrived within {self.timeout.total_seconds():g}s")
        except Exception as error:
            raise PipelineError(
                f"rank {self.me}: stage {to_stage}, micro-batch {micro_batch}: receive of the {kind} from stage "
                f"{from_stage} (rank {peer}) failed after {time.monotonic() - started:.1f}s: {error}. The other "
                "stage raised or stopped; its own error names the pass that failed"
            ) from error
        return buffer

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
