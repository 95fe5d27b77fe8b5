"""The Redis backend: existing servers named by URL, or Bagua's layout of one server per node.

redis-py is the client. Connections are opened lazily in each process (DataLoader workers
included) with short timeouts, so that a dead server costs a refused connection, not a hang.
"""

import os

import redis

from .node_servers import node_rank, node_server_urls
from .sharded_store import ShardedStore

__all__ = ["RedisStore", "RedisServerStore", "as_url"]

CONNECT_SECONDS = 2
IO_SECONDS = 10


def as_url(host):
    """``redis://host:port`` from a URL or from Bagua's ``{"host": ..., "port": ...}``."""
    if isinstance(host, dict):
        return f"redis://{host['host']}:{host['port']}/0"
    if isinstance(host, str) and host.startswith(("redis://", "rediss://", "unix://")):
        return host
    raise ValueError(f"a Redis server is a redis://host:port URL or {{'host': ..., 'port': ...}}, not {host!r}")


class RedisServerStore:
    """Bagua's store interface on one Redis server."""

    def __init__(self, url):
        self.url = url
        self._client, self._pid = None, None

    def __getstate__(self):
        return {"url": self.url}

    def __setstate__(self, state):
        self.__init__(state["url"])

    @property
    def client(self):
        if self._pid != os.getpid():
            self._client = redis.Redis.from_url(self.url, socket_connect_timeout=CONNECT_SECONDS,
                                                socket_timeout=IO_SECONDS)
            self._pid = os.getpid()
        return self._client

    def get(self, key):
        return self.client.get(key)

    def mget(self, keys):
        return self.client.mget(keys)

    def set(self, key, value):
        self.client.set(key, value)

    def mset(self, mapping):
        self.client.mset(mapping)

    def delete(self, keys):
        if keys:
            self.client.delete(*keys)

    def delete_prefix(self, prefix):
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in prefix) + "*"
        batch = []
        for key in self.client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                self.client.delete(*batch)
                batch = []
        self.delete(batch)

    def num_keys(self):
        return self.client.dbsize()

    def clear(self):
        self.client.flushdb()

    def status(self):
        return bool(self.client.ping())

    def shutdown(self):
        """Close this process's connections; servers are stopped by whoever started them."""
        if self._client is not None and self._pid == os.getpid():
            self._client.close()
        self._client, self._pid = None, None


class RedisStore(ShardedStore):
    """Bagua's ``RedisStore``: ``hosts`` None starts (on local rank 0) or joins this node's server
    and finds every node's; otherwise ``hosts`` lists existing servers. ``cluster_mode`` spreads
    keys over all servers by hash; without it each node uses server ``node_rank % len(hosts)``.
    ``capacity_per_node`` (bytes) applies to servers started here."""

    def __init__(self, hosts=None, cluster_mode=True, capacity_per_node=None):
        if isinstance(hosts, (str, dict)):
            hosts = [hosts]
        urls = node_server_urls(capacity_per_node) if hosts is None else [as_url(h) for h in hosts]
        if not urls:
            raise ValueError("RedisStore needs at least one server")
        if not cluster_mode:
            urls = [urls[node_rank() % len(urls)]]
        super().__init__([RedisServerStore(u) for u in urls])
