"""The 1-bit compressed all-reduce of 1-bit Adam and 1-bit LAMB (C18), with error feedback
on the worker side and on the server side (Tang et al., 2021, "1-bit Adam", Algorithm 1
and §4.1; Li et al., 2021, "1-bit LAMB").

Every rank of the group holds a vector x whose length is a multiple of 8·N; the result,
written back into x, is the same vector on every rank: an average of the ranks' vectors
that crossed the network at one bit per element.

1. Worker: x + e_worker is cut into N chunks; chunk j is sent as its signs (one bit per
   element, packed 8 per byte, 1 for >= 0) and one fp32 scale s = ||chunk|| / √len, the
   scale at which the signs have the chunk's own L2 norm. What this loses stays in
   e_worker for the next call. One all-to-all: chunk j goes to rank j.
2. Server (rank j, for chunk j): the N decompressed chunks it received are averaged,
   e_server is added, and the result is compressed again the same way (e_server keeps
   the loss). One all-gather of the compressed chunks: every rank decompresses the same
   averaged vector.

Error feedback is what makes the compression unbiased over time: whatever one step's
signs get wrong is added to the next step's input. Both collectives go through the
group's `Communicator`, so `comm_volume()` counts exactly what crosses the wire: per rank
and call, 2 · (N − 1)/N · (len(x)/8 + 4N) bytes, against 2 · (N − 1)/N · 4·len(x) for an
fp32 all-reduce (shardwise/formulas/communication.py `onebit_exchange_bytes`).
"""

from __future__ import annotations

import math
import sys

import torch

from shardwise.runtime.distributed.collectives import Communicator

BITS = 8
SCALE_BYTES = 4  # one fp32 scale per chunk, sent beside the chunk's packed signs
_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def padded_length(numel: int, ranks: int) -> int:
    """`numel` rounded up to a multiple of 8·ranks: whole bytes in every rank's chunk."""
    unit = BITS * ranks
    return math.ceil(numel / unit) * unit


# x · _PACK >> 56, x eight 0/1 bytes read as one little-endian int64: the top byte gathers
# byte i's bit into bit 7 − i (the other partial products land below bit 56 on distinct
# bits, so they never carry into it, or above bit 63 and wrap away)
_PACK = sum(1 << (63 - 9 * i) for i in range(BITS)) - (1 << 64)


def pack_signs(positive: torch.Tensor) -> torch.Tensor:
    """Booleans (..., 8k) -> uint8 (..., k), the first element in the highest bit: one
    multiply and shift per eight elements (a little-endian machine's byte order)."""
    if sys.byteorder != "little" or not positive.is_contiguous():
        return _pack_signs_bitwise(positive)
    words = positive.view(torch.uint8).reshape(-1).view(torch.int64)
    return (words * _PACK).bitwise_right_shift_(56).bitwise_and_(255).to(torch.uint8).view(
        *positive.shape[:-1], -1)


def _pack_signs_bitwise(positive: torch.Tensor) -> torch.Tensor:
    bits = positive.reshape(*positive.shape[:-1], -1, BITS).view(torch.uint8)
    packed = bits[..., 0] << (BITS - 1)
    for position in range(1, BITS):
        packed.bitwise_or_(bits[..., position] << (BITS - 1 - position))
    return packed


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (..., k) -> booleans (..., 8k): the inverse of `pack_signs`."""
    bits = packed.unsqueeze(-1).bitwise_and(_WEIGHTS.to(packed.device)).bool()
    return bits.reshape(*packed.shape[:-1], -1)


# every byte's eight signs as ±1.0: decompressing is a table lookup and one multiply
_SIGNS_OF_BYTE = unpack_signs(torch.arange(256, dtype=torch.uint8).view(-1, 1)).float().mul_(2).sub_(1)


def signs_from_packed_(target: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """`target` (rows, 8k) fp32 becomes ±1.0 from `packed` (rows, k) sign bytes, in place:
    one table lookup per byte, eight values written."""
    table = _SIGNS_OF_BYTE.to(target.device)
    torch.index_select(table, 0, packed.reshape(-1).long(), out=target.view(-1, BITS))
    return target


def signed_from_packed_(target: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`target` (rows, 8k) fp32 becomes ±scale from `packed` (rows, k) sign bytes, in place."""
    return signs_from_packed_(target, packed).mul_(scales)


def row_scales(rows: torch.Tensor) -> torch.Tensor:
    """One scale per row, ||row|| / √len: the scaled signs keep the row's L2 norm."""
    return torch.linalg.vector_norm(rows, dim=-1, keepdim=True) / math.sqrt(rows.shape[-1])


class CompressedAllReduce:
    """The averaging exchange over `communicator`'s group for vectors of `numel` elements
    (a multiple of 8·N), with the two error-feedback buffers it keeps between calls."""

    def __init__(self, communicator: Communicator, numel: int, device: torch.device):
        ranks = communicator.size
        if numel % (BITS * ranks):
            raise ValueError(f"a compressed all-reduce over {ranks} ranks needs a length that is a multiple of "
                             f"{BITS * ranks} (whole bytes per chunk); got {numel}: pad with padded_length()")
        self.communicator = communicator
        self.numel = numel
        self.chunk = numel // ranks
        self.worker_error = torch.zeros(numel, dtype=torch.float32, device=device)
        self.server_error = torch.zeros(self.chunk, dtype=torch.float32, device=device)

    @property
    def state_bytes(self) -> int:
        """The error buffers: the whole vector on the worker side, one chunk on the server side."""
        return 4 * (self.worker_error.numel() + self.server_error.numel())

    def all_reduce_(self, vector: torch.Tensor, what: str) -> torch.Tensor:
        """Replace `vector` (fp32, `numel` elements) by the compressed average over the group.
        Once folded into the worker's error buffer, `vector` serves as scratch space.

        What each compression loses is taken off its error buffer as e − (±1)·s in one
        pass over the signs decoded from the packed bytes (exact: (±1)·s is ±s), and the
        server sums the received chunks as ±1 times each sender's scale, so no ±s vector
        is ever materialised beside the signs."""
        ranks, chunk = self.communicator.size, self.chunk
        packed_width = chunk // BITS
        rows = vector.view(ranks, chunk)
        compensated = self.worker_error.add_(vector).view(ranks, chunk)
        scales = row_scales(compensated)
        packed = pack_signs(compensated >= 0)
        compensated.addcmul_(signs_from_packed_(rows, packed), scales, value=-1)  # what the compression loses
        outgoing = _frame(packed, scales)
        incoming = torch.empty_like(outgoing)
        self.communicator.all_to_all(incoming, outgoing, f"1-bit {what} (worker signs and scales)").wait()

        received, received_scales = _unframe(incoming, packed_width)
        average, term = rows[:1], rows[-1:]
        signed_from_packed_(average, received[:1], received_scales[:1])
        for sender in range(1, ranks):
            signs_from_packed_(term, received[sender : sender + 1])
            average.add_(term, alpha=received_scales[sender].item())
        average = average.view(-1)
        self.server_error.add_(average.div_(ranks))  # the compensated server chunk
        server_scale = row_scales(self.server_error.view(1, chunk))
        server_packed = pack_signs((self.server_error >= 0).view(1, chunk))
        self.server_error.addcmul_(signs_from_packed_(average, server_packed).view(-1), server_scale.view(()), value=-1)
        shard = _frame(server_packed, server_scale).view(-1)
        gathered = torch.empty(ranks * shard.numel(), dtype=torch.uint8, device=vector.device)
        self.communicator.all_gather(gathered, shard, f"1-bit {what} (server signs and scales)").wait()

        all_packed, all_scales = _unframe(gathered.view(ranks, -1), packed_width)
        signed_from_packed_(rows, all_packed, all_scales)
        return vector


def _frame(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Rows of packed signs, each followed by its fp32 scale's 4 bytes: one message per rank."""
    frame = torch.empty(packed.shape[0], packed.shape[1] + SCALE_BYTES, dtype=torch.uint8, device=packed.device)
    frame[:, : packed.shape[1]] = packed
    frame[:, packed.shape[1] :] = scales.reshape(-1, 1).contiguous().view(torch.uint8)
    return frame


def _unframe(frame: torch.Tensor, packed_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed signs, scales as a column) of framed rows."""
    return frame[:, :packed_width], frame[:, packed_width:].contiguous().view(torch.float32)
