"""DeepSpeed's communication logger (`deepspeed.comm.configure`, `log_summary`, the config's
`comms_logger` block): the collectives a script calls through `deepspeed.comm`, each timed
and counted by message size, summarised with DeepSpeed's bandwidth arithmetic.

What it sees is what passes through `deepspeed.comm` (api/comm.py). The engine's own
collectives do not: shardwise counts those itself, per group and kind, in
`engine.comm_volume(per_group=True)`, which is what to read for ZeRO's traffic.

Bandwidth as DeepSpeed 0.19.8 computes it (deepspeed/utils/comms_logging.py `calc_bw_log`,
Gbps = bytes · 8 / 1e6 over milliseconds): the algorithm's throughput and the bus
bandwidth, with n ranks:

    all_to_all(_single)                      size / t,        busbw = size / t · (n − 1) / n
    all_gather(_into_tensor), reduce_scatter n · size / t,    busbw = n · size / t · (n − 1) / n
    all_reduce(_coalesced)                   2 · size / t,    busbw = size / t · 2(n − 1) / n
    point to point, broadcast, reduce, ...   size / t,        busbw = size / t
"""

from __future__ import annotations

import datetime
import functools
import inspect
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

_GATHERS = {"all_gather", "all_gather_into_tensor", "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor"}
_ALL_TO_ALL = {"all_to_all", "all_to_all_single"}
_ALL_REDUCE = {"all_reduce", "all_reduce_coalesced", "inference_all_reduce"}


@dataclass
class CommsLogger:
    """The logger's switches (DeepSpeed's `comms_logger` block) and what it recorded:
    per operation, per message size in bytes, the latencies in milliseconds."""

    enabled: bool = False
    prof_all: bool = True
    prof_ops: list[str] = field(default_factory=list)
    verbose: bool = False
    debug: bool = False
    records: dict[str, dict[int, list[float]]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))

    def profiles(self, name: str, asked: bool = False) -> bool:
        """Whether a call is timed: the logger on, and the call asked (`prof=True`), or
        every operation profiled, or its name listed in `prof_ops`."""
        return self.enabled and (asked or self.prof_all or name in self.prof_ops)

    def append(self, name: str, size: int, milliseconds: float) -> None:
        self.records[name][size].append(milliseconds)
        if self.verbose:
            print(f"comm op: {name} | time (ms): {milliseconds:.2f} | msg size: {_readable(size)}")


COMMS_LOGGER = CommsLogger()


def configure(deepspeed_config: Any = None, enabled: bool | None = None, prof_all: bool | None = None,
              prof_ops: list[str] | None = None, verbose: bool | None = None, debug: bool | None = None) -> None:
    """Set the logger's switches: from a config's `comms_logger` block (a dict, or an object
    with `comms_config` / `comms_logger`), then from the arguments given."""
    block = _block_of(deepspeed_config)
    settings = {**block, **{key: value for key, value in (("enabled", enabled), ("prof_all", prof_all),
                                                          ("prof_ops", prof_ops), ("verbose", verbose),
                                                          ("debug", debug)) if value is not None}}
    for key, value in settings.items():
        if hasattr(COMMS_LOGGER, key) and key != "records":
            setattr(COMMS_LOGGER, key, list(value) if key == "prof_ops" else bool(value))


def _block_of(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config.get("comms_logger", {}))
    for name in ("comms_config", "comms_logger"):
        block = getattr(config, name, None)
        if block is not None:
            return block if isinstance(block, dict) else dict(vars(block))
    return {}


def logged(function: Callable[..., Any]) -> Callable[..., Any]:
    """Time `function` (a `deepspeed.comm` collective) when the logger profiles it: the
    device synchronised after it, as DeepSpeed does, its message counted as DeepSpeed counts it.
    DeepSpeed's logging arguments of every collective (`prof`, `log_name`, `debug`) are
    taken: `log_name` names the record, `prof=True` times this call."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def timed(*args: Any, prof: bool = False, log_name: str | None = None, debug: Any = None, **kwargs: Any) -> Any:
        name = log_name or function.__name__
        if not COMMS_LOGGER.profiles(name, prof):
            return function(*args, **kwargs)
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            bound = signature.bind_partial(*args, **kwargs)
            COMMS_LOGGER.append(name, _message_bytes(bound.arguments), (time.perf_counter() - started) * 1e3)

    return timed


# The argument a collective's message is, by name, as DeepSpeed looks for it (deepspeed/comm/utils.py)
_MESSAGE_ARGUMENTS = ("tensor", "tensors", "input_list", "input_tensor_list", "p2p_op_list")


def _message_bytes(arguments: dict[str, Any]) -> int:
    """The bytes of the first argument DeepSpeed counts as the message (a list: all its
    tensors, a P2POp's own); none of them (a barrier, an object list): 0."""
    name = next((name for name in _MESSAGE_ARGUMENTS if name in arguments), None)
    if name is None:
        return 0
    value = arguments[name]
    tensors = [getattr(item, "tensor", item) for item in value] if isinstance(value, (list, tuple)) else [value]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors if isinstance(tensor, torch.Tensor))


def bandwidths(name: str, size: int, milliseconds: float, ranks: int) -> tuple[float, float]:
    """(throughput, bus bandwidth) in Gbps, DeepSpeed's arithmetic (see the module's docstring)."""
    if milliseconds <= 0:
        return 0.0, 0.0
    rate = size / milliseconds
    if name in _ALL_TO_ALL:
        throughput, bus = rate, rate * (ranks - 1) / ranks
    elif name in _GATHERS:
        throughput = rate * ranks
        bus = throughput * (ranks - 1) / ranks
    elif name in _ALL_REDUCE:
        throughput, bus = 2 * rate, rate * 2 * (ranks - 1) / ranks
    else:
        throughput = bus = rate
    return throughput * 8 / 1e6, bus * 8 / 1e6


def summary(ranks: int, rank: int) -> dict[str, Any]:
    """`log_summary(return_dict=True)`'s dictionary, as DeepSpeed 0.19.8 builds it."""
    table: dict[str, dict[int, dict[str, Any]]] = {}
    for name, sizes in COMMS_LOGGER.records.items():
        table[name] = {}
        for size, latencies in sorted(sizes.items()):
            total = sum(latencies)
            rates = [bandwidths(name, size, latency, ranks) for latency in latencies]
            table[name][size] = {"count": len(latencies), "total_latency_ms": total,
                                 "avg_latency_ms": total / len(latencies),
                                 "tput_avg_gbps": sum(r[0] for r in rates) / len(rates),
                                 "busbw_avg_gbps": sum(r[1] for r in rates) / len(rates),
                                 "msg_size_bytes": size, "msg_size_str": _readable(size)}
    return {"summary": table, "straggler_analysis": None,
            "metadata": {"world_size": ranks, "rank": rank, "timestamp": datetime.datetime.now().isoformat()}}


def print_summary(result: dict[str, Any]) -> None:
    print(f"{'Comm. Op':<20}{'Message Size':<20}{'Count':<20}{'Total Latency(ms)':<20}{'Avg Latency(ms)':<20}"
          f"{'tput_avg (Gbps)':<20}{'busbw_avg (Gbps)':<20}")
    for name, sizes in result["summary"].items():
        print(name)
        for row in sizes.values():
            print(f"{'':<20}{row['msg_size_str']:<20}{row['count']:<20}{row['total_latency_ms']:<20.2f}"
                  f"{row['avg_latency_ms']:<20.2f}{row['tput_avg_gbps']:<20.2f}{row['busbw_avg_gbps']:<20.2f}")


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict[str, Any] | None:
    """Rank 0 prints what was logged; every rank returns the dictionary with `return_dict`.
    `show_straggler` (DeepSpeed's spread between ranks) is not computed: its entry is None."""
    initialized = dist.is_initialized()
    if initialized:
        dist.barrier()
    ranks, rank = (dist.get_world_size(), dist.get_rank()) if initialized else (1, 0)
    result = summary(ranks, rank)
    if rank == 0:
        print_summary(result)
    if initialized:
        dist.barrier()
    return result if return_dict else None


def reset_log() -> None:
    COMMS_LOGGER.records.clear()


def has_comm_data() -> bool:
    return bool(COMMS_LOGGER.records)


def get_comm_operation_count() -> int:
    return sum(len(latencies) for sizes in COMMS_LOGGER.records.values() for latencies in sizes.values())


def get_logged_comm_ops() -> list[str]:
    return list(COMMS_LOGGER.records)


def _readable(size: int) -> str:
    """Bytes as DeepSpeed's table shows them: B below 1 KB, else KB, MB or GB to 2 decimals."""
    if size < 1024:
        return f"{size} B"
    scaled, unit = size / 1024, "KB"
    for larger in ("MB", "GB"):
        if scaled < 1024:
            break
        scaled, unit = scaled / 1024, larger
    return f"{scaled:.2f} {unit}"
