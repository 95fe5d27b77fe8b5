"""The process groups hierarchical reduce runs on: one per node, and one of the node leaders.

Which ranks share a node is the job's topology (autopatch/topology.py), the answer every room
gets. Ranks on one node form a local group, and each node's lowest rank joins the leaders' group
that carries the only traffic between nodes.
"""

from dataclasses import dataclass

import torch.distributed as dist

from ..topology import topology


@dataclass
class NodeGroups:
    local_group: object      # this node's ranks
    leaders_group: object    # one rank per node; None on ranks that are not their node's leader
    leader: int              # global rank of this node's leader
    is_leader: bool
    local_size: int
    nodes: int


def node_groups():
    """This rank's node groups. A collective over the world: every rank calls it together."""
    topo, rank = topology(), dist.get_rank()
    local_group = leaders_group = None
    for node in range(topo.nodes):
        group = dist.new_group(topo.ranks_of(node))
        if node == topo.node_of[rank]:
            local_group = group
    group = dist.new_group(topo.leaders)
    leader = topo.leader_of(rank)
    if rank == leader:
        leaders_group = group
    return NodeGroups(local_group, leaders_group, leader, rank == leader, topo.local_size(rank), topo.nodes)
