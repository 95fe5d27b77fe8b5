"""Which ranks exchange weights: every rank of the group, or, hierarchically, one per node.

With ``hierarchical`` each node first averages its ranks' weights onto its leader (the node's
lowest rank), the leaders run the exchange among themselves, and each leader broadcasts the
result back to its node, so only leaders send between nodes. The node topology is
``comm/hierarchy.py``'s, and like the bucketed allreduce's it needs the group to be the world.
"""

import torch.distributed as dist

from ..hierarchy import build_topology


class ExchangeStages:
    def __init__(self, group, device, hierarchical, who):
        self.topology = None
        if hierarchical:
            if dist.get_world_size(group) != dist.get_world_size():
                raise ValueError(f"autopatch {who}: hierarchical=True groups ranks by node across the "
                                 "whole world, so the model's process group must be the world")
            self.topology = build_topology(device)
            self.group = self.topology.leaders_group
            self.size = self.topology.nodes
            self.takes_part = self.topology.is_leader
        else:
            self.group = group
            self.size = dist.get_world_size(group)
            self.takes_part = True
        self.rank = dist.get_rank(self.group) if self.takes_part else -1

    @property
    def exchanging(self):
        """This rank exchanges with others (a leader of several nodes, or any rank when flat)."""
        return self.takes_part and self.size > 1

    def global_rank(self, r):
        return dist.get_global_rank(self.group, r)

    def around(self, flat, exchange):
        """Phases of one exchange of ``flat``: the node's average onto its leader, then
        ``exchange(flat)``'s phases where this rank exchanges, then the result back to the node."""
        yield from self.node_average(flat)
        if self.exchanging:
            yield from exchange(flat)
        yield from self.node_broadcast(flat)

    def node_average(self, flat):
        """Phases: the node's average onto its leader (nothing when flat or alone on its node)."""
        topo = self.topology
        if topo is not None and topo.local_size > 1:
            flat.mul_(1.0 / topo.local_size)
            yield dist.reduce(flat, dst=topo.leader, group=topo.local_group, async_op=True)

    def node_broadcast(self, flat):
        topo = self.topology
        if topo is not None and topo.local_size > 1:
            yield dist.broadcast(flat, src=topo.leader, group=topo.local_group, async_op=True)

    def node_bytes(self, nbytes):
        """Bytes this rank sends within its node for one average and one broadcast."""
        topo = self.topology
        if topo is None or topo.local_size < 2:
            return 0
        return 2 * (topo.local_size - 1) * nbytes // topo.local_size    # ring reduce, then broadcast
