"""ZeRO-Offload's host tier (C11): fp32 masters, optimizer state and the reduced gradient
partition in host memory; the optimizer steps there, on the CPU.

What stays on the device: the 16-bit (or fp32) parameters the model computes with, and,
in stages 0-1, the full gradient buffer the micro-batches accumulate into (the reduced
owned slice is handed to the host at the boundary). Stages 2-3 hand every reduced bucket
chunk over as it arrives, so the device keeps no gradient partition at all (Ren et al.,
2021: "ZeRO-Offload"). The host partition is fp32: the CPU optimizer steps in fp32, so
gradients are upcast once on arrival instead of at every use.

The design is device-generic: on a CPU-only machine the "host" is the same memory as the
"device", but the buffers are separate and counted under the host tier, so tests check
where every byte would live on a GPU machine. With CUDA, buffers are pinned
(`pin_memory`) so host<->device copies can run asynchronously.
"""

from __future__ import annotations

import torch

from shardwise.accounting import MemoryLedger, tensor_bytes
from shardwise.zero.layout import FlatUnit
from shardwise.zero.shard_store import ShardStore, copy_into_flat
from shardwise.zero.strategy import ParameterStrategy

HOST = torch.device("cpu")


class HostShardStore(ShardStore):
    tier = "host"
    state_tier = "host"

    def __init__(
        self,
        units: list[FlatUnit],
        chunk: int,
        strategy: ParameterStrategy,
        grad_dtype: torch.dtype,
        keeps_full_gradients: bool,
        sub_group_size: int,
        ledger: MemoryLedger,
        per_parameter: bool = False,
        pin_memory: bool = False,
    ):
        param_chunks = [strategy.owned_chunk(unit) for unit in units]
        device = param_chunks[0].device
        pin = pin_memory and torch.cuda.is_available()
        # an optimizer on the host needs its own fp32 copy, whatever the training dtype
        self.master_flat, masters = copy_into_flat(param_chunks, torch.float32, HOST, pin)
        full_grads = None
        self.full_flat = None
        if keeps_full_gradients:
            sizes = [unit.padded_numel for unit in units]
            self.full_flat = torch.zeros(sum(sizes), dtype=grad_dtype, device=device)
            ledger.hold("grads", tensor_bytes(self.full_flat))
            full_grads = list(torch.split(self.full_flat, sizes))
        sizes = [unit.chunk_numel for unit in units]
        self.grad_flat = torch.zeros(sum(sizes), dtype=torch.float32, device=HOST, pin_memory=pin)
        ledger.hold("grads", tensor_bytes(self.grad_flat), tier="host")
        grads = list(torch.split(self.grad_flat, sizes))
        self._organise(units, chunk, param_chunks, masters, full_grads, grads, per_parameter, sub_group_size)

    def start_window(self) -> None:
        """The host partition collects this window's reduced gradients from zero."""
        self.grad_flat.zero_()

    def zero_gradients(self) -> None:
        self.grad_flat.zero_()
        if self.full_flat is not None:
            self.full_flat.zero_()

    def master_bytes(self) -> int:
        return tensor_bytes(self.master_flat)
