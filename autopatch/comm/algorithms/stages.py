"""Which ranks exchange weights: every rank of the group, or, hierarchically, one per node.

With ``hierarchical`` each node first averages its ranks' weights onto its leader (the node's
lowest rank), the leaders run the exchange among themselves, and each leader broadcasts the
result back to its node, so only leaders send between nodes. The node groups are
``comm/hierarchy.py``'s, and like the bucketed allreduce's it needs the group to be the world.
"""

import torch.distributed as dist

from ...topology import why_not_hierarchical
from ..hierarchy import node_groups


class ExchangeStages:
    def __init__(self, group, hierarchical, who):
        self.nodes = None        # NodeGroups while hierarchical
        if hierarchical:
            why = why_not_hierarchical(group)
            if why:
                raise ValueError(f"autopatch {who}: hierarchical=True: {why}")
            self.nodes = node_groups()
            self.group = self.nodes.leaders_group
            self.size = self.nodes.nodes
            self.takes_part = self.nodes.is_leader
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
        """Stages of one exchange of ``flat``: the node's average onto its leader, then
        ``exchange(flat)``'s stages where this rank exchanges, then the result back to the node."""
        yield from self.node_average(flat)
        if self.exchanging:
            yield from exchange(flat)
        yield from self.node_broadcast(flat)

    def node_average(self, flat):
        """Stages: the node's average onto its leader (nothing when flat or alone on its node)."""
        nodes = self.nodes
        if nodes is not None and nodes.local_size > 1:
            flat.mul_(1.0 / nodes.local_size)
            yield dist.reduce(flat, dst=nodes.leader, group=nodes.local_group, async_op=True)

    def node_broadcast(self, flat):
        nodes = self.nodes
        if nodes is not None and nodes.local_size > 1:
            yield dist.broadcast(flat, src=nodes.leader, group=nodes.local_group, async_op=True)

    def node_bytes(self, nbytes):
        """Bytes this rank sends within its node for one average and one broadcast."""
        nodes = self.nodes
        if nodes is None or nodes.local_size < 2:
            return 0
        return 2 * (nodes.local_size - 1) * nbytes // nodes.local_size    # ring reduce, then broadcast
