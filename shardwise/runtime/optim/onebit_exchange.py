"""The 1-bit compressed all-reduce (distributed/compressed.py) with its arithmetic in the
native kernels (optim/native.py), for 1-bit Adam and 1-bit LAMB on CPU.

In torch operations the exchange makes over a dozen passes over the momentum (the error
added, a norm, a comparison, the packing multiply, the signs decoded into a scratch
vector, the error taken off, the server's sum, its own compression, the final decode);
here the worker makes two (the error added with its norm, then the signs packed with
the error's update), the server two over its chunk, and the decode one. The messages are
byte for byte the torch path's form (each rank's packed signs followed by its fp32
scale), so the exchange's bytes are those `onebit_exchange_bytes` counts; the arithmetic
is the same but for the norms, summed here in double: a scale may differ in its last
bit, and an element exactly at a sign's tie may then fall the other way.
"""

from __future__ import annotations

import torch

from shardwise.runtime.distributed.compressed import BITS, SCALE_BYTES, CompressedAllReduce
from shardwise.runtime.optim import native


class NativeCompressedAllReduce(CompressedAllReduce):
    """The same exchange and error-feedback buffers; fp32 CPU vectors go through the
    kernels, anything else (GPU, no compiler, `SHARDWISE_NATIVE_OPTIM=0`) through the
    torch path."""

    def all_reduce_(self, vector: torch.Tensor, what: str) -> torch.Tensor:
        if not (vector.dtype == torch.float32 and native.enabled() and native.takes(vector, self.worker_error)):
            return super().all_reduce_(vector, what)
        library, ranks, chunk = native.library(), self.communicator.size, self.chunk
        width = chunk // BITS
        frame = width + SCALE_BYTES  # one rank's message: its packed signs, then its scale
        outgoing = torch.empty(ranks, frame, dtype=torch.uint8)
        scales = torch.empty(ranks, dtype=torch.float32)
        for rank in range(ranks):  # worker: chunk `rank` of x + e goes to rank `rank`
            at = 4 * rank * chunk
            library.onebit_compress(vector.data_ptr() + at, self.worker_error.data_ptr() + at, chunk,
                                    outgoing.data_ptr() + rank * frame, scales.data_ptr() + 4 * rank)
        outgoing[:, width:] = scales.view(ranks, 1).view(torch.uint8)
        incoming = torch.empty_like(outgoing)
        self.communicator.all_to_all(incoming, outgoing, f"1-bit {what} (worker signs and scales)").wait()

        average = vector[:chunk]  # server: the received chunks' average, in x's first chunk (scratch now)
        received_scales = incoming[:, width:].contiguous().view(torch.float32)
        library.onebit_average(incoming.data_ptr(), frame, received_scales.data_ptr(), ranks, chunk,
                               average.data_ptr())
        shard = torch.empty(frame, dtype=torch.uint8)
        server_scale = torch.empty(1, dtype=torch.float32)
        library.onebit_compress(average.data_ptr(), self.server_error.data_ptr(), chunk, shard.data_ptr(),
                                server_scale.data_ptr())
        shard[width:] = server_scale.view(torch.uint8)
        gathered = torch.empty(ranks * frame, dtype=torch.uint8)
        self.communicator.all_gather(gathered, shard, f"1-bit {what} (server signs and scales)").wait()

        all_scales = gathered.view(ranks, frame)[:, width:].contiguous().view(torch.float32)
        library.onebit_decode(gathered.data_ptr(), frame, all_scales.data_ptr(), ranks, chunk, vector.data_ptr())
        return vector
