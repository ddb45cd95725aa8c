"""Ranks agree before they train: same config, same model, same optimizer settings.

Data-parallel training silently assumes every replica is built identically. When that
fails the symptoms are far from the cause: ranks whose models register the same
parameters in a different order (a `ModuleDict` built from a `set`) train to different
weights; a learning rate that differs per rank diverges quietly; a different width, stage
or bucket size makes gloo abort the process ("Received data size doesn't match") or
waits out the collective timeout.

So `initialize` runs one small all-gather before anything else: per rank, a digest of
the resolved config (and optimizer hyper-parameters), a digest of the model description
(parameter names, shapes, dtypes, order, param groups), and the rank's host and pid (kept
for naming peers whose connection is lost). Config digests must match across the world;
model digests across ranks that hold the same part of the model. Only when a digest
differs are the full descriptions exchanged, to name the first differing key or parameter.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable

import torch
from torch import nn

from shardwise.runtime.distributed.collectives import Communicator
from shardwise.runtime.distributed.peers import PeerDirectory, host_fingerprint, local_address


class RankMismatchError(RuntimeError):
    """Ranks were set up differently (config, model or optimizer)."""


def describe_config(config: dict[str, Any], optimizer: torch.optim.Optimizer | None) -> list[str]:
    """`key = value` lines of the resolved config plus the optimizer's settings, sorted."""
    lines = [f"{key} = {value!r}" for key, value in _flatten(config)]
    if optimizer is not None:
        lines.append(f"optimizer class = {type(optimizer).__name__}")
        for index, group in enumerate(optimizer.param_groups):
            for key, value in sorted(group.items()):
                if key not in ("params", "param_names"):
                    lines.append(f"optimizer param group {index} {key} = {value!r}")
    return sorted(lines)


def describe_model(model: nn.Module, group_of: Callable[[nn.Parameter], int | None]) -> list[str]:
    """One line per parameter and persistent buffer, in registration order."""
    lines = []
    for name, param in model.named_parameters():
        group = group_of(param)
        trained = "trainable" if param.requires_grad else "frozen"
        place = "" if group is None else f" in param group {group}"
        lines.append(f"parameter {name} {tuple(param.shape)} {param.dtype} {trained}{place}")
    for name, buffer in model.named_buffers():
        lines.append(f"buffer {name} {tuple(buffer.shape)} {buffer.dtype}")
    return lines


def check_ranks_agree(
    world: Communicator,
    config_lines: list[str],
    model_lines: list[str],
    model_groups: list[list[int]],
    device: torch.device | None = None,
) -> PeerDirectory:
    """Raise `RankMismatchError` on every rank when ranks differ, or when two ranks of one
    host train on the same GPU; returns every rank's host and pid. `model_groups` lists
    the global ranks that must hold the same model."""
    mine = torch.tensor(
        [_digest(config_lines), _digest(model_lines), host_fingerprint(), os.getpid(), local_address(),
         gpu_identity(device)],
        dtype=torch.int64,
    )
    if world.size == 1:
        return PeerDirectory((int(mine[2]),), (int(mine[3]),), (int(mine[4]),))
    gathered = torch.zeros(world.size * mine.numel(), dtype=torch.int64)
    world.all_gather_control(gathered, mine, "the start-up check that ranks agree on config and model")
    rows = gathered.view(world.size, -1).tolist()
    _refuse_shared_gpus(rows)
    config_differs = len({row[0] for row in rows}) > 1
    model_differs = any(len({rows[rank][1] for rank in group}) > 1 for group in model_groups)
    if config_differs or model_differs:
        everyone = world.control_all_gather_object((config_lines, model_lines))
        if config_differs:
            raise RankMismatchError(_first_difference(
                [lines for lines, _ in everyone], list(range(world.size)), "config",
                "every rank must load the same config and build the same optimizer",
            ))
        group = next(group for group in model_groups if len({rows[rank][1] for rank in group}) > 1)
        raise RankMismatchError(_first_difference(
            [everyone[rank][1] for rank in group], group, "model",
            "every rank must build the same model in the same order (e.g. no ModuleDict built "
            "from a set, no rank-dependent sizes)",
        ))
    return PeerDirectory(tuple(row[2] for row in rows), tuple(row[3] for row in rows), tuple(row[4] for row in rows))


def gpu_identity(device: torch.device | None) -> int:
    """A digest of the CUDA device's UUID (0 off CUDA): two processes that see their GPU
    under different indices (per-process CUDA_VISIBLE_DEVICES) still compare equal."""
    if device is None or device.type != "cuda":
        return 0
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return int.from_bytes(hashlib.sha256(uuid.encode()).digest()[:7], "big")


def _refuse_shared_gpus(rows: list[list[int]]) -> None:
    """NCCL refuses two ranks on one GPU only in their first collective ("Duplicate GPU
    detected"), deep in start-up; here the ranks sharing one are named."""
    owner: dict[tuple[int, int], int] = {}
    for rank, row in enumerate(rows):
        host, gpu = row[2], row[5]
        if gpu == 0:
            continue
        if (host, gpu) in owner:
            raise RankMismatchError(
                f"ranks {owner[host, gpu]} and {rank} run on the same GPU of one host: NCCL needs a GPU per "
                "rank. Start at most as many processes per node as it has GPUs, and when a launcher sets "
                "CUDA_VISIBLE_DEVICES per process, give each process a different GPU"
            )
        owner[host, gpu] = rank


def _first_difference(descriptions: list[list[str]], ranks: list[int], what: str, fix: str) -> str:
    reference = descriptions[0]
    for rank, lines in zip(ranks[1:], descriptions[1:]):
        if lines == reference:
            continue
        for position, (ours, theirs) in enumerate(zip(reference, lines)):
            if ours != theirs:
                return (f"ranks disagree on the {what} before training: line {position + 1} is "
                        f"'{ours}' on rank {ranks[0]} but '{theirs}' on rank {rank}; {fix}")
        longer, count = (ranks[0], len(reference)) if len(reference) > len(lines) else (rank, len(lines))
        extra = (reference if longer == ranks[0] else lines)[min(len(reference), len(lines))]
        return (f"ranks disagree on the {what} before training: rank {longer} has {count} lines, "
                f"the first extra one '{extra}'; {fix}")
    return f"ranks disagree on the {what} before training; {fix}"


def _flatten(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(node, dict):
        items: list[tuple[str, Any]] = []
        for key, value in node.items():
            items += _flatten(value, f"{prefix}{key}.")
        return items
    return [(prefix[:-1], node)]


def _digest(lines: list[str]) -> int:
    return int.from_bytes(hashlib.sha256(json.dumps(lines).encode()).digest()[:7], "big")
