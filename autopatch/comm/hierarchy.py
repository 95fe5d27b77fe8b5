"""Which ranks share a node, and the process groups hierarchical reduce runs on.

torchrun tells every worker its node through ``GROUP_RANK`` (and ``LOCAL_RANK`` /
``LOCAL_WORLD_SIZE``); ranks on one node form a local group, and the lowest rank of each node
joins the leaders' group that carries the only traffic between nodes.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collectives import all_gather_into


@dataclass
class Topology:
    local_group: object      # this node's ranks
    leaders_group: object    # one rank per node; None on ranks that are not their node's leader
    leader: int              # global rank of this node's leader
    is_leader: bool
    local_size: int
    nodes: int


def node_id(environ=None):
    """This worker's node: torchrun's GROUP_RANK, else RANK // LOCAL_WORLD_SIZE, else one node."""
    env = os.environ if environ is None else environ
    if "GROUP_RANK" in env:
        return int(env["GROUP_RANK"])
    if "RANK" in env and "LOCAL_WORLD_SIZE" in env:
        return int(env["RANK"]) // max(1, int(env["LOCAL_WORLD_SIZE"]))
    return 0


def build_topology(device):
    """Gather every rank's node and create the groups. A collective: all ranks call it together."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = torch.tensor([node_id()], dtype=torch.int64, device=device)
    every = torch.empty(world, dtype=torch.int64, device=device)
    all_gather_into(every, mine)
    nodes = every.tolist()
    local_group = leaders_group = None
    members = {}
    for node in sorted(set(nodes)):
        members[node] = [r for r, n in enumerate(nodes) if n == node]
        group = dist.new_group(members[node])
        if node == nodes[rank]:
            local_group = group
    leaders = [ranks[0] for ranks in members.values()]
    group = dist.new_group(leaders)
    local = members[nodes[rank]]
    if rank in leaders:
        leaders_group = group
    return Topology(local_group, leaders_group, local[0], rank == local[0], len(local), len(members))
