"""Which ranks share a node (C28): past one node, bytes between nodes decide the speed.

Launchers say how many processes they started on each node (torchrun's, and
`shardwise run`'s, LOCAL_WORLD_SIZE); ranks are numbered node by node, so ranks
r·L .. r·L+L−1 are node r's. A job may also state it (`TopologyPolicy.ranks_per_node`,
the config's `topology.ranks_per_node`): for launchers that do not set the variable, and
to simulate nodes on one machine (4 ranks as 2 nodes × 2), where the collectives run the
same and only the accounting of which link they cross changes.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger("shardwise")

LAUNCHER_VARIABLE = "LOCAL_WORLD_SIZE"


@dataclass(frozen=True)
class TopologyPolicy:
    ranks_per_node: int | None = None  # None: the launcher's LOCAL_WORLD_SIZE, else every rank on one node

    def __post_init__(self) -> None:
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be at least 1, got {self.ranks_per_node}")


def ranks_per_node(policy: TopologyPolicy, world_size: int) -> int | None:
    """The node size: the policy's, else the launcher's when it divides the world (nodes
    of unequal sizes cannot be described: then one node, with a warning); None: one node."""
    if policy.ranks_per_node is not None:
        if world_size % policy.ranks_per_node:
            raise ValueError(f"topology.ranks_per_node {policy.ranks_per_node} does not divide the {world_size} "
                             "ranks of the job: every node must hold the same number of ranks")
        return policy.ranks_per_node
    launched = os.environ.get(LAUNCHER_VARIABLE, "")
    if not launched.isdigit() or int(launched) < 1:
        return None
    if world_size % int(launched):
        log.warning("shardwise: %s=%s does not divide the %d ranks (nodes of unequal sizes); bytes are counted as "
                    "if on one node", LAUNCHER_VARIABLE, launched, world_size)
        return None
    return int(launched)
