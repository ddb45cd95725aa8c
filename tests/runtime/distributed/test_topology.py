"""Nodes in the mesh (C28): ranks per node from the launcher or the config, the groups cut
by node, and the bytes each collective sends inside a node and between nodes (4 ranks
simulated as 2 nodes x 2; docs/formulas.md#bytes-between-nodes)."""

import pytest
import torch

from shardwise.frontends.deepspeed.config import ConfigError, load_config
from shardwise.frontends.deepspeed.config.policies import policies_from_config
from shardwise.runtime.distributed.collectives import CommStats, Communicator
from shardwise.runtime.distributed.mesh import ParallelMesh, ParallelSizes
from shardwise.runtime.distributed.setup import collective_timeout
from shardwise.runtime.distributed.topology import TopologyPolicy, ranks_per_node
from shardwise.runtime.engine.job import parallel_sizes
from shardwise.tools.testing import run_distributed


def sizes_for(world: int, **config) -> ParallelSizes:
    return parallel_sizes(policies_from_config(load_config({"train_batch_size": 8 * world, **config}, world_size=world)),
                          world)


def test_nodes_come_from_the_config_else_the_launcher(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ranks_per_node(TopologyPolicy(), 8) == 4
    assert ranks_per_node(TopologyPolicy(2), 8) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # nodes of unequal sizes: counted as one node
    assert ranks_per_node(TopologyPolicy(), 8) is None
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert ranks_per_node(TopologyPolicy(), 8) is None
    with pytest.raises(ValueError, match="topology.ranks_per_node 3 does not divide the 8 ranks"):
        ranks_per_node(TopologyPolicy(3), 8)
    with pytest.raises(ConfigError, match="topology.ranks_per_node"):
        load_config({"train_batch_size": 8, "topology": {"ranks_per_node": 0}}, world_size=2)


def test_groups_cut_by_node():
    sizes = sizes_for(8, topology={"ranks_per_node": 4},
                      zero_optimization={"stage": 3, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True})
    assert (sizes.nodes, sizes.node_of(5)) == (2, 1)
    assert sizes.groups("node") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert sizes.groups("nodes") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert sizes.groups("shard_node") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert sizes.groups("shard_nodes") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert sizes.groups("secondary") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert sizes.describe().endswith("(2 nodes of 4)")
    # with tensor parallelism inside the node, the shard group takes every other rank
    tensor = sizes_for(8, topology={"ranks_per_node": 4}, tensor_parallel={"size": 2},
                       zero_optimization={"stage": 3, "zero_quantized_gradients": True})
    assert tensor.groups("shard") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert tensor.groups("shard_node") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert tensor.groups("shard_nodes") == [[0, 4], [2, 6], [1, 5], [3, 7]]


def test_layouts_the_hierarchy_cannot_cut_are_refused():
    with pytest.raises(ValueError, match="3 ranks per node do not divide the 8 ranks"):
        ParallelSizes(data_shard=8, ranks_per_node=3)
    with pytest.raises(ValueError, match="does not divide the 2 ranks of a shard group on each node"):
        ParallelSizes(data_shard=4, ranks_per_node=2, secondary_shard=4, shard_by_node=True).groups("secondary")
    uneven = ParallelSizes(pipeline=2, data_shard=3, ranks_per_node=2, shard_by_node=True)
    with pytest.raises(ValueError, match=r"the shard group \[0, 1, 2\] has \{0: 2, 1: 1\} ranks"):
        uneven.groups("shard_node")


SIZES = ParallelSizes(data_shard=4, ranks_per_node=2, secondary_shard=2, shard_by_node=True)


def collectives_by_link(rank: int, world_size: int) -> dict:
    mesh = ParallelMesh(SIZES, rank, torch.device("cpu"), collective_timeout())
    stats = CommStats()
    shard, node, nodes = (Communicator(mesh[purpose], stats) for purpose in ("shard", "node", "nodes"))
    values = torch.full((8,), float(rank))
    gathered = torch.empty(32)
    shard.all_gather(gathered, values, "a ring over both nodes").wait()
    exchanged = torch.empty(8)
    shard.all_to_all(exchanged, values, "an all-to-all over both nodes").wait()
    node.all_reduce(values.clone(), "inside the node").wait()
    nodes.all_reduce(values.clone(), "across the nodes").wait()
    groups = {purpose: list(mesh[purpose].ranks) for purpose in ("node", "nodes", "shard_node", "shard_nodes",
                                                                   "secondary")}
    return {"links": stats.by_link(), "groups": groups, "gathered": gathered.tolist(),
            "exchanged": exchanged.tolist()}


def test_bytes_are_counted_by_the_link_they_cross():
    results = run_distributed(collectives_by_link, 4)
    assert results[1]["groups"] == {"node": [0, 1], "nodes": [1, 3], "shard_node": [0, 1], "shard_nodes": [1, 3],
                                    "secondary": [0, 1]}
    assert results[0]["gathered"] == [0.0] * 8 + [1.0] * 8 + [2.0] * 8 + [3.0] * 8
    assert results[3]["exchanged"] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    # all-gather of 128 bytes over 4: 96 sent, all of it to the successor: rank 1 -> 2 and
    # rank 3 -> 0 cross between nodes, ranks 0 and 2 stay inside theirs
    # all-to-all of 32 bytes over 4: 8 to each peer, two of them on the other node
    # all-reduce of 32 bytes over 2: 32 sent, inside the node (node group) or across (nodes group)
    for rank, result in enumerate(results):
        crosses = rank in (1, 3)
        assert result["links"]["inter_node"] == {"all_gather": 96 * crosses, "all_to_all": 16, "all_reduce": 32}
        assert result["links"]["intra_node"] == {"all_gather": 96 * (not crosses), "all_to_all": 8,
                                                 "all_reduce": 32}
