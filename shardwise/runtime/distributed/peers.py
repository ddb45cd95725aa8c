"""Which rank a lost connection belonged to.

gloo reports a dead peer as "Connection closed by peer [10.0.0.7]:41234": an address and
an ephemeral port, not a rank. Every rank's host and process id are exchanged once at
start-up (inside the agreement check `initialize` runs anyway), so a communicator whose
collective failed can say "rank 3 (pid 4242 on this host) is no longer running", or at
least which ranks live on the host the message names.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

_CONNECTION_LOST = ("connection closed", "connection reset", "broken pipe", "connection refused")
_ADDRESS = re.compile(r"\[([0-9a-fA-F.:]+)\]")


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
