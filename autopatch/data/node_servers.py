"""Bagua's Redis layout: one server per node, started by its lowest rank, addresses shared through
the process group's store.

The lowest rank of each node starts a ``RedisServer`` (in a run without a process group, the
process itself) and publishes its URL under ``autopatch/data/redis/node{n}``; every rank waits,
for at most ``PUBLISH_SECONDS``, for every node's URL. Which ranks share a node is the job's
topology (autopatch/topology.py), the one answer every room gets, whatever the number of ranks
on each node. On one node the server listens on 127.0.0.1 only;
across nodes on every interface, behind its random password.
"""

import datetime
import os
import socket

from ..topology import topology
from .redis_server import RedisServer

__all__ = ["node_server_urls", "node_rank", "default_capacity_per_node", "started_server"]

PUBLISH_SECONDS = 120
KEY = "autopatch/data/redis/node{}"
_started = {}   # this process's answer: {"urls": [...], "server": RedisServer or None}


def _layout():
    """(world size, this node, number of nodes, whether this rank starts its node's server)."""
    topo = topology()
    return topo.world, topo.node_of[topo.rank], topo.nodes, topo.leader_of(topo.rank) == topo.rank


def node_rank():
    return _layout()[1]


def default_capacity_per_node():
    """A quarter of the node's memory: a server larger than memory would be killed, not evict."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError):
        return 8 << 30


def _reachable_address():
    """The address other nodes reach this one by: the interface that routes to MASTER_ADDR."""
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, 1))   # no packet is sent: this only picks the route
                return s.getsockname()[0]
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


def node_server_urls(capacity=None):
    """Every node's server URL in node order, starting this node's server if this process is its
    node's lowest rank. Called again, returns the same answer."""
    if "urls" in _started:
        return _started["urls"]
    world, node, nodes, starts_server = _layout()
    capacity = capacity or default_capacity_per_node()
    if world == 1:
        server = RedisServer(capacity)
        _started.update(urls=[server.url], server=server)
        return _started["urls"]
    from ..torch_internals import default_store
    store = default_store()
    server = None
    if starts_server:
        server = (RedisServer(capacity) if nodes == 1 else
                  RedisServer(capacity, bind="0.0.0.0", advertise=_reachable_address()))
        store.set(KEY.format(node), server.url)
    keys = [KEY.format(n) for n in range(nodes)]
    store.wait(keys, datetime.timedelta(seconds=PUBLISH_SECONDS))
    _started.update(urls=[store.get(k).decode() for k in keys], server=server)
    return _started["urls"]


def started_server():
    """The server this process started, or None."""
    return _started.get("server")
