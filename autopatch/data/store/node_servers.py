"""Bagua's Redis layout: one server per node, started by its lowest rank, addresses shared through
the process group's store.

The lowest rank of each node starts a ``RedisServer`` (in a run without a process group, the
process itself) and publishes its address under ``autopatch/data/redis/node{n}``; every rank waits,
for at most ``PUBLISH_SECONDS``, for every node's address. Which ranks share a node is the job's
topology (autopatch/topology.py), the one answer every room gets, whatever the number of ranks
on each node. On one node the server listens on 127.0.0.1 only; across nodes on the address the
other nodes reach it by (the interface that routes to MASTER_ADDR), never on every interface.

The password is never sent: every rank derives it from the user's key (``user_key``), so the
store, which other local users can read, holds addresses only.
"""

import os
import socket

from ...job_store import exchange, job_store
from ...topology import topology
from .redis_server import RedisServer
from .user_key import derived

__all__ = ["node_server_urls", "node_rank", "default_capacity_per_node", "started_server"]

PUBLISH_SECONDS = 120     # how long a rank waits for every node's lowest rank to start its server
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


def _password():
    return derived("redis password").hex()


def _with_password(address):
    return address.replace("redis://", f"redis://:{_password()}@", 1)


def node_server_urls(capacity=None):
    """Every node's server URL (with the password) in node order, starting this node's server if
    this process is its node's lowest rank. Called again, returns the same answer."""
    if "urls" in _started:
        return _started["urls"]
    world, node, nodes, starts_server = _layout()
    capacity = capacity or default_capacity_per_node()
    if world == 1:
        server = RedisServer(capacity, password=_password())
        _started.update(urls=[server.url], server=server)
        return _started["urls"]
    store = job_store()
    server = None
    mine = None
    if starts_server:
        if nodes == 1:
            server = RedisServer(capacity, password=_password())
        else:
            address = _reachable_address()
            server = RedisServer(capacity, bind=address, advertise=address, password=_password())
        mine = (KEY.format(node), server.address)
    addresses = exchange(store, [KEY.format(n) for n in range(nodes)], PUBLISH_SECONDS,
                         "every node's Redis server address", mine=mine)
    _started.update(urls=[_with_password(a.decode()) for a in addresses], server=server)
    return _started["urls"]


def started_server():
    """The server this process started, or None."""
    return _started.get("server")
