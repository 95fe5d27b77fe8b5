"""Which ranks share a node: one answer per job, for every room that asks.

A node is what torchrun calls one (``GROUP_RANK``, the same on every worker of one agent), else
``RANK // LOCAL_WORLD_SIZE`` where a launcher sets both, else the machine's host name. Every rank publishes its node under its rank in the default process group's
store and reads everyone's: no collective is issued, so rooms may ask at different moments (the
DDP takeover when a model is built, the data cache when a loader is), and nodes may hold different
numbers of ranks. Where torch offers no store, one ``all_gather_object`` over the world does it.

``Topology`` is the answer: each rank's node (numbered in order of their lowest rank), the ranks
of each node, its leader (its lowest rank), and a rank's place on its node. The hierarchical
algorithms group ranks by node across the whole world, so they need a group that is the world
(``why_not_hierarchical``).
"""

import os
import socket
from dataclasses import dataclass

from . import dist as _dist
from .job_store import exchange, job_store

KEY = "autopatch/topology/{}/rank{}"
PUBLISH_SECONDS = 300     # how long a rank waits for the others to say where they are
_known = {}               # (the default group's id, world size, rank) -> Topology
_exchanges = [0]          # exchanges this process has made: every rank makes the same ones


@dataclass(frozen=True)
class Topology:
    node_of: tuple        # rank -> node index
    rank: int = 0         # this process's rank (0 in a single process)

    @property
    def world(self):
        return len(self.node_of)

    @property
    def nodes(self):
        return max(self.node_of) + 1

    def ranks_of(self, node):
        return [r for r, n in enumerate(self.node_of) if n == node]

    @property
    def leaders(self):
        """Each node's lowest rank, in node order."""
        return [self.ranks_of(n)[0] for n in range(self.nodes)]

    def leader_of(self, rank):
        return self.ranks_of(self.node_of[rank])[0]

    def local_rank(self, rank):
        return self.ranks_of(self.node_of[rank]).index(rank)

    def local_size(self, rank):
        return len(self.ranks_of(self.node_of[rank]))

    def describe(self):
        return {"nodes": self.nodes, "ranks_per_node": [len(self.ranks_of(n)) for n in range(self.nodes)],
                "leaders": self.leaders}


def node_key(environ=None):
    """This process's node: torchrun's GROUP_RANK, else RANK // LOCAL_WORLD_SIZE, else the host name."""
    env = os.environ if environ is None else environ
    if env.get("GROUP_RANK", "").strip():
        return f"node {int(env['GROUP_RANK'])}"
    try:
        return f"node {int(env['RANK']) // max(1, int(env['LOCAL_WORLD_SIZE']))}"
    except (KeyError, ValueError):
        return f"host {socket.gethostname()}"


def topology():
    """The job's Topology (one node for a single process). The first call of each rank in a
    process group waits, for at most PUBLISH_SECONDS, for every rank's first call; later calls
    answer at once."""
    world, rank = _dist.world_size(), _dist.rank()
    cache_key = (_dist.default_group_id(), world, rank)
    known = _known.get(cache_key)
    if known is None:
        keys = [node_key()] if world == 1 else _exchange(world, rank)
        order = list(dict.fromkeys(keys))
        known = _known[cache_key] = Topology(tuple(order.index(k) for k in keys), rank if world > 1 else 0)
    return known


def forget():
    """Forget the topology: the next question exchanges it again. Every rank calls it at the same
    point (a program that moves its processes between machines without a new process group)."""
    _known.clear()


def _exchange(world, rank):
    store = job_store()
    mine = node_key()
    generation = _exchanges[0]
    _exchanges[0] += 1
    if store is None:
        import torch.distributed as dist
        keys = [None] * world
        dist.all_gather_object(keys, mine)
        return keys
    names = [KEY.format(generation, r) for r in range(world)]
    answers = exchange(store, names, PUBLISH_SECONDS, "every rank to say which node it is on",
                       mine=(names[rank], mine))
    return [answer.decode() for answer in answers]


def why_not_hierarchical(group):
    """None when ``group`` may reduce hierarchically, else why not: grouping ranks by node needs
    every rank of the job, so the group must be the world."""
    import torch.distributed as dist
    if dist.get_world_size(group) == dist.get_world_size():
        return None
    return ("hierarchical groups ranks by node across the whole world, but this process group is "
            "smaller than the world")
