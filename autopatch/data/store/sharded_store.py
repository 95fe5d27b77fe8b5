"""Entries spread over several stores by a hash of their key, so that every node holds a share.

The hash is CRC-32 of the key: stable across processes and runs (Python's ``hash`` is not) and
in the standard library. Only routing lives here; each store keeps its own connections.
"""

import zlib

__all__ = ["ShardedStore"]


class ShardedStore:
    def __init__(self, stores):
        if not stores:
            raise ValueError("ShardedStore needs at least one store")
        self.stores = list(stores)

    def _shard(self, key):
        return zlib.crc32(key.encode()) % len(self.stores)

    def route(self, key):
        return self.stores[self._shard(key)]

    def _by_store(self, keys):
        groups = {}
        for k in keys:
            groups.setdefault(self._shard(k), []).append(k)
        return [(self.stores[i], part) for i, part in groups.items()]

    def get(self, key):
        return self.route(key).get(key)

    def set(self, key, value):
        self.route(key).set(key, value)

    def mget(self, keys):
        found = {}
        for store, part in self._by_store(keys):
            found.update(zip(part, store.mget(part)))
        return [found[k] for k in keys]

    def mset(self, mapping):
        for store, part in self._by_store(mapping):
            store.mset({k: mapping[k] for k in part})

    def delete(self, keys):
        for store, part in self._by_store(keys):
            store.delete(part)

    def delete_prefix(self, prefix):
        for s in self.stores:
            s.delete_prefix(prefix)

    def num_keys(self):
        return sum(s.num_keys() for s in self.stores)

    def clear(self):
        for s in self.stores:
            s.clear()

    def status(self):
        return all(s.status() for s in self.stores)

    def shutdown(self):
        for s in self.stores:
            s.shutdown()
