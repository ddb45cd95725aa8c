"""DeepSpeed's hostfile and its resource flags: which hosts a job runs on, and which
device slots of each.

A hostfile has a line `HOST slots=N` per host (comments start with `#`); `--include` /
`--exclude` take `HOST[:SLOT[,SLOT...]][@HOST...]`, `--num_nodes` keeps the first hosts,
`--num_gpus` the first slots of each. The results are DeepSpeed 0.19.8's, read off its
own functions (tests/tools/launcher/test_hostfile.py compares them when DeepSpeed is
installed), with one difference: a host left with no slot is refused here, where
DeepSpeed would start a node of no process.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

_HOST_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")


def read_hostfile(path: str | Path) -> dict[str, int]:
    """Host -> slot count, in the file's order."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no hostfile at {path}: write one line `HOST slots=N` per host")
    return parse_hostfile(path.read_text().splitlines(), source=str(path))


def parse_hostfile(lines: Iterable[str], *, source: str = "hostfile") -> dict[str, int]:
    pool: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _HOST_LINE.search(line)
        if match is None:
            raise ValueError(f"{source}:{number}: {line!r} is not `HOST slots=N`")
        host, slots = match.group(1), int(match.group(2))
        if host in pool:
            raise ValueError(f"{source}:{number}: {host} is listed twice; give each host one line")
        pool[host] = slots
    if not pool:
        raise ValueError(f"{source} lists no host: write one line `HOST slots=N` per host")
    return pool


def select_slots(
    pool: dict[str, int], *, include: str = "", exclude: str = "", num_nodes: int = -1, num_gpus: int = -1
) -> dict[str, list[int]]:
    """Host -> the slots (device indices) the job uses there, in the hostfile's order.

    `include` and `exclude` are mutually exclusive, and exclusive with `num_nodes` /
    `num_gpus` (given at all, as DeepSpeed counts any value >= 0)."""
    if include and exclude:
        raise ValueError("--include and --exclude are mutually exclusive: name the hosts to use, or those to skip")
    if (include or exclude) and (num_nodes >= 0 or num_gpus >= 0):
        raise ValueError("--num_nodes / --num_gpus cannot be combined with --include / --exclude")
    available = {host: list(range(slots)) for host, slots in pool.items()}
    chosen = _filter(available, include, exclude) if include or exclude else available
    if num_nodes > 0:
        chosen = dict(list(chosen.items())[:num_nodes])
    if num_gpus > 0:
        chosen = {host: list(range(num_gpus)) for host in chosen}
    empty = [host for host, slots in chosen.items() if not slots]
    if empty:
        raise ValueError(f"host {empty[0]} has slots=0: give it a slot count, or --exclude {empty[0]}")
    if not chosen:
        raise ValueError("--exclude leaves no host to run on")
    return chosen


def _filter(available: dict[str, list[int]], include: str, exclude: str) -> dict[str, list[int]]:
    """DeepSpeed's filter: a bare host means all its slots; slots named for a host in
    several specs are merged (and then the bare mention of that host is not a whole-host
    one)."""
    chosen: dict[str, list[int]] = {} if include else {host: list(slots) for host, slots in available.items()}
    for host, slots in _node_specs(include or exclude).items():
        if host not in available:
            raise ValueError(f"host {host!r} of --{'include' if include else 'exclude'} is not in the hostfile")
        for slot in slots:
            if slot not in available[host]:
                raise ValueError(f"host {host} has no slot {slot} (slots 0..{len(available[host]) - 1})")
        if include:
            chosen[host] = slots or list(available[host])
        else:
            chosen[host] = [slot for slot in chosen[host] if slot not in slots] if slots else []
    return {host: chosen[host] for host in available if chosen.get(host)}


def _node_specs(text: str) -> dict[str, list[int]]:
    specs: dict[str, set[int]] = {}
    for spec in text.split("@"):
        host, separator, slots = spec.partition(":")
        named = specs.setdefault(host, set())
        if separator:
            try:
                named.update(int(slot) for slot in slots.split(","))
            except ValueError:
                raise ValueError(f"{spec!r}: slots are integers, as in HOST:0,2") from None
    return {host: sorted(slots) for host, slots in specs.items()}
