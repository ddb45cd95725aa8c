"""Which rank a lost connection belonged to.

gloo reports a dead peer as "Connection closed by peer [10.0.0.7]:41234": an address and
an ephemeral port, not a rank. Every rank's host and process id are exchanged once at
start-up (inside the agreement check `initialize` runs anyway), so a communicator whose
collective failed can say "rank 3 (pid 4242 on this host) is no longer running", or at
least which ranks live on the host the message names.

Before that exchange, a rank that died during start-up leaves the others with gloo's
"Wait timeout" while they build the first groups. So each rank also signs in to the
process group's store as start-up begins (`sign_in`), and a start-up that fails names
the ranks that never signed in, or signed in and are no longer running (`absent_ranks`).
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from itertools import count

import torch.distributed as dist

_CONNECTION_LOST = ("connection closed", "connection reset", "broken pipe", "connection refused")
_ADDRESS = re.compile(r"\[([0-9a-fA-F.:]+)\]")
_SIGN_IN = "shardwise/signed-in/{start}/{rank}"
_STARTS = count()  # start-ups in this process: every rank builds its engines in the same order


def sign_in(rank: int) -> int:
    """Note in the store that `rank` (this process) began start-up number N; returns N."""
    start = next(_STARTS)
    store = dist.distributed_c10d._get_default_store()  # private, but unchanged over the supported torch
    store.set(_SIGN_IN.format(start=start, rank=rank), f"{host_fingerprint()} {os.getpid()}")
    return start


def absent_ranks(start: int, world_size: int) -> str:
    """The ranks that did not sign in to start-up `start`, or that did and have exited
    (those on this host); "" when every rank is there, or the store cannot say."""
    try:
        store = dist.distributed_c10d._get_default_store()
        here, missing, dead = host_fingerprint(), [], []
        for rank in range(world_size):
            key = _SIGN_IN.format(start=start, rank=rank)
            if not store.check([key]):
                missing.append(rank)
                continue
            host, pid = map(int, store.get(key).decode().split())
            if host == here and not _alive(pid):
                dead.append(f"rank {rank} (pid {pid} on this host) is no longer running")
    except Exception:  # the store's host may be the rank that died
        return ""
    if missing:
        dead.insert(0, f"rank(s) {', '.join(map(str, missing))} never began initialize (it exited or failed "
                       "before, or is still busy with something else)")
    return "; ".join(dead)


def host_fingerprint() -> int:
    """A number naming this host, the same in every process on it (FNV-1a of its name)."""
    value = 1469598103934665603
    for byte in socket.gethostname().encode():
        value = ((value ^ byte) * 1099511628211) % (2**61)
    return value


def local_address() -> int:
    """This host's IPv4 address as an integer (0 when it cannot be resolved)."""
    try:
        return int.from_bytes(socket.inet_aton(socket.gethostbyname(socket.gethostname())), "big")
    except OSError:
        return 0


@dataclass(frozen=True)
class PeerDirectory:
    """Host fingerprint, host address and process id of every global rank."""

    hosts: tuple[int, ...]
    pids: tuple[int, ...]
    addresses: tuple[int, ...]

    def describe_lost(self, ranks: tuple[int, ...], error: BaseException) -> str:
        """A sentence naming the peer(s) behind a connection-loss error, or ""."""
        text = str(error).lower()
        if not any(marker in text for marker in _CONNECTION_LOST):
            return ""
        here = host_fingerprint()
        dead = [rank for rank in ranks if self.hosts[rank] == here and not _alive(self.pids[rank])]
        if dead:
            names = ", ".join(f"rank {rank} (pid {self.pids[rank]})" for rank in dead)
            return f" [{names} on this host is no longer running]"
        match = _ADDRESS.search(str(error))
        address = _ipv4(match.group(1)) if match else 0
        if address:
            remote = [rank for rank in ranks if self.addresses[rank] == address]
            if remote and all(self.hosts[rank] != here for rank in remote):
                return f" [the lost peer is one of rank(s) {', '.join(map(str, remote))} on {match.group(1)}]"
        return ""


def _alive(pid: int) -> bool:
    """Running, and not a zombie waiting for its parent to collect its exit status."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _ipv4(text: str) -> int:
    try:
        return int.from_bytes(socket.inet_aton(text), "big")
    except OSError:
        return 0
