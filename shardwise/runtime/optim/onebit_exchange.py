"""The 1-bit compressed all-reduce (distributed/compressed.py) with its arithmetic in the
native kernels (optim/native.py), for 1-bit Adam and 1-bit LAMB on CPU.

In torch operations the exchange makes over a dozen passes over the momentum (the error
added, a norm, a comparison, the packing multiply, the signs decoded into a scratch
vector, the error taken off, the server's sum, its own compression, the final decode).
Here each compression is one pass: the signs do not depend on the scale, so they are
packed in the pass that adds the input to the error buffer and sums its squares, and
what the compression loses (±scale per element, known once that pass has the norm) is
taken off in the next call's pass, from the message kept since. The worker makes that
one pass over the vector, the server one over its chunk (the received signs' average
added to its error as it goes), and the decode is the caller's: `exchange_` hands back
the gathered signs, so 1-bit Adam decodes them in its update's pass; and given the
momentum fold (`MomentumFolds`), the worker's pass folds each rank's gradient into the
momentum as it adds it to the error, so the folded momentum is never written. The
messages are byte for byte the torch path's form (each rank's packed signs followed by
its fp32 scale), so the exchange's bytes are those `onebit_exchange_bytes` counts; the
arithmetic is the same, in the same order, but for the norms, summed here in double: a
scale may differ in its last bit, and an element exactly at a sign's tie may then fall
the other way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.distributed.compressed import BITS, SCALE_BYTES, CompressedAllReduce
from shardwise.runtime.optim import native


@dataclass(frozen=True)
class MomentumFolds:
    """m <- β1·m + (1 − β1)·g over segments of the flat momentum, for the worker's first
    pass: row k of `bounds` is a segment's [begin, end) (ascending, disjoint), `grads[k]`
    the address of its fp32 gradient (0: none, m <- β1·m), `factors[k]` (β1, 1 − β1) in
    fp32. Elements of no segment (padding) are exchanged as they are."""

    bounds: torch.Tensor
    grads: torch.Tensor
    factors: torch.Tensor

    @classmethod
    def of(cls, segments: list[tuple[int, int, torch.Tensor | None, float]]) -> MomentumFolds:
        """From (first flat index, element count, gradient or None, β1) per trained tensor,
        each gradient fp32, contiguous, on the CPU and as long as its tensor."""
        segments = sorted(segments, key=lambda segment: segment[0])
        return cls(bounds=torch.tensor([[start, start + numel] for start, numel, _, _ in segments],
                                       dtype=torch.int64).reshape(-1, 2),
                   grads=torch.tensor([0 if grad is None else grad.data_ptr() for _, _, grad, _ in segments],
                                      dtype=torch.int64),
                   factors=torch.tensor([[beta1, 1 - beta1] for _, _, _, beta1 in segments],
                                        dtype=torch.float32).reshape(-1, 2))


@dataclass(frozen=True)
class GatheredSigns:
    """The exchange's result before it is decoded: every rank's message (its chunk's packed
    signs, then its fp32 scale) as `packed`'s rows, and those scales."""

    packed: torch.Tensor
    scales: torch.Tensor
    chunk: int

    def decode_(self, momentum: torch.Tensor, start: int) -> None:
        """`momentum` (a contiguous view of the flat momentum from its element `start` on)
        becomes the average."""
        native.library().onebit_decode_apply(
            self.packed.data_ptr(), self.packed.shape[1], self.scales.data_ptr(), self.chunk, start,
            momentum.numel(), momentum.data_ptr(), None, None, 0.0, 0.0, 0.0, 0)

    def decode_adam_update_(self, momentum: torch.Tensor, updates: AdamUpdates) -> None:
        """The trained tensors' elements of the flat `momentum` become the average, and in
        the same pass each tensor's weights step: 1-bit Adam's update."""
        native.library().onebit_decode_adam_apply(
            self.packed.data_ptr(), self.packed.shape[1], self.scales.data_ptr(), self.chunk, momentum.data_ptr(),
            updates.table.shape[0], updates.table.data_ptr(), updates.settings.data_ptr(),
            updates.eps_inside_sqrt.data_ptr())


@dataclass(frozen=True)
class AdamUpdates:
    """1-bit Adam's update of each trained tensor, w += scale·(m / d(v) + weight_decay·w)
    with d Adam's denominator, for the decode's pass: row k of `table` is a tensor's first
    flat index in the momentum, its element count and the addresses of its variance and
    weights (fp32, contiguous, CPU); of `settings` its scale, eps and weight decay."""

    table: torch.Tensor
    settings: torch.Tensor
    eps_inside_sqrt: torch.Tensor

    @classmethod
    def of(cls, updates: list[tuple[int, torch.Tensor, torch.Tensor, float, float, float, bool]]) -> AdamUpdates:
        """From (first flat index, variance, weights, scale, eps, weight decay,
        eps_inside_sqrt) per trained tensor."""
        return cls(table=torch.tensor([[start, param.numel(), variance.data_ptr(), param.data_ptr()]
                                       for start, variance, param, *_ in updates], dtype=torch.int64).reshape(-1, 4),
                   settings=torch.tensor([settings[3:6] for settings in updates], dtype=torch.float32).reshape(-1, 3),
                   eps_inside_sqrt=torch.tensor([int(settings[6]) for settings in updates], dtype=torch.int32))


class NativeCompressedAllReduce(CompressedAllReduce):
    """The same exchange and error-feedback buffers; fp32 CPU vectors go through the
    kernels, anything else (GPU, no compiler, `SHARDWISE_NATIVE_OPTIM=0`) through the
    torch path.

    Each compression is one pass (native_kernels.c): what it loses is taken off its error
    buffer in the next call's pass, from the message it sent, kept until then. Reading
    `worker_error` or `server_error` takes it off first, so they read as the torch path's."""

    def __init__(self, communicator: Communicator, numel: int, device: torch.device):
        self._worker_pending: tuple[torch.Tensor, torch.Tensor] | None = None  # sent signs and scales, per chunk
        self._server_pending: tuple[torch.Tensor, float] | None = None
        super().__init__(communicator, numel, device)

    @property
    def worker_error(self) -> torch.Tensor:
        if self._worker_pending is not None:
            outgoing, scales = self._worker_pending
            self._worker_pending = None
            for rank, scale in enumerate(scales.tolist()):
                native.library().onebit_settle(self._worker_error.data_ptr() + 4 * rank * self.chunk, self.chunk,
                                               outgoing[rank].data_ptr(), scale)
        return self._worker_error

    @worker_error.setter
    def worker_error(self, value: torch.Tensor) -> None:
        self._worker_error, self._worker_pending = value, None

    @property
    def server_error(self) -> torch.Tensor:
        if self._server_pending is not None:
            shard, scale = self._server_pending
            self._server_pending = None
            native.library().onebit_settle(self._server_error.data_ptr(), self.chunk, shard.data_ptr(), scale)
        return self._server_error

    @server_error.setter
    def server_error(self, value: torch.Tensor) -> None:
        self._server_error, self._server_pending = value, None

    def takes(self, vector: torch.Tensor) -> bool:
        """Whether the kernels can exchange `vector`."""
        return vector.dtype == torch.float32 and native.enabled() and native.takes(vector, self._worker_error)

    def all_reduce_(self, vector: torch.Tensor, what: str) -> torch.Tensor:
        if not self.takes(vector):
            return super().all_reduce_(vector, what)
        self.exchange_(vector, what).decode_(vector, 0)
        return vector

    def exchange_(self, vector: torch.Tensor, what: str, folds: MomentumFolds | None = None,
                  known: GatheredSigns | None = None) -> GatheredSigns:
        """The compressed average of `vector` (the caller checked `takes`), its signs not yet
        decoded; with `folds`, `vector` is the momentum before this rank's fold, which the
        worker's pass applies. `vector` itself is left as it is. With `known` (an earlier
        result of this exchange that `vector` is, element for element, the decode of), the
        worker's pass reads `vector` from those signs rather than from memory."""
        library, ranks, chunk = native.library(), self.communicator.size, self.chunk
        width = chunk // BITS
        frame = width + SCALE_BYTES  # one rank's message: its packed signs, then its scale
        outgoing = torch.empty(ranks, frame, dtype=torch.uint8)
        scales = torch.empty(ranks, dtype=torch.float32)
        pending, pending_scales = self._worker_pending or (None, None)
        segments = (0, None, None, None) if folds is None else (
            folds.bounds.shape[0], folds.bounds.data_ptr(), folds.grads.data_ptr(), folds.factors.data_ptr())
        # worker: chunk `rank` of x + e goes to rank `rank`, every chunk in one pass
        library.onebit_worker_compress(vector.data_ptr(), self._worker_error.data_ptr(), chunk, ranks, frame,
                                       *segments, native.pointer(pending), native.pointer(pending_scales),
                                       None if known is None else known.packed.data_ptr(),
                                       None if known is None else known.scales.data_ptr(), outgoing.data_ptr(),
                                       scales.data_ptr())
        self._worker_pending = (outgoing, scales)
        outgoing[:, width:] = scales.view(ranks, 1).view(torch.uint8)
        incoming = torch.empty_like(outgoing)
        self.communicator.all_to_all(incoming, outgoing, f"1-bit {what} (worker signs and scales)").wait()

        received_scales = incoming[:, width:].contiguous().view(torch.float32)  # server: chunk `rank`
        shard = torch.empty(frame, dtype=torch.uint8)
        server_scale = torch.empty(1, dtype=torch.float32)
        shard_pending, shard_pending_scale = self._server_pending or (None, 0.0)
        library.onebit_server_compress(incoming.data_ptr(), frame, received_scales.data_ptr(), ranks, chunk,
                                       self._server_error.data_ptr(),
                                       None if shard_pending is None else shard_pending.data_ptr(),
                                       shard_pending_scale, shard.data_ptr(), server_scale.data_ptr())
        self._server_pending = (shard, server_scale.item())
        shard[width:] = server_scale.view(torch.uint8)
        gathered = torch.empty(ranks, frame, dtype=torch.uint8)
        self.communicator.all_gather(gathered.view(-1), shard, f"1-bit {what} (server signs and scales)").wait()
        return GatheredSigns(gathered, gathered[:, width:].contiguous().view(torch.float32).view(-1), chunk)
