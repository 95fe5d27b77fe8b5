"""Bagua's ``CacheLoader``: what an expensive function returns, kept in a store by key.

An entry's key is ``"{dataset_name}_{key}"``; its value is the encoded value (``sample_codec``)
after an optional ``stamp``. ``CachedDataset`` stamps its entries with its dataset's signature,
so an entry written for another version of the dataset reads as a miss, never as a wrong sample.
Misses are computed by the caller's function and written back in batches of
``writer_buffer_size`` with one ``mset``; a batch still waiting is written when the process exits
(DataLoader workers included). Store errors are misses and dropped writes (``store_guard``).
"""

import os
import pickle
import warnings

from .backends import backend_name, open_store
from .process_exit import at_exit
from .sample_codec import Unstorable, decode, encode
from .shared_counters import SharedCounters
from .store_guard import StoreGuard

__all__ = ["CacheLoader"]

_MISS = object()


class CacheLoader:
    def __init__(self, backend="local", dataset_name="", writer_buffer_size=1, stamp=b"", **kwargs):
        """``backend``: ``"local"`` (node-local lmdb), ``"redis"`` (a server per node) or
        ``redis://host:port`` URLs; ``kwargs`` go to the store (see ``backends.open_store``). A
        store that cannot be opened (no redis-server, an unwritable directory) is reported and
        warned about, and every sample is then computed."""
        self.backend = backend
        self.dataset_name = dataset_name
        self.writer_buffer_size = max(1, int(writer_buffer_size))
        self.stamp = bytes(stamp)
        self.counters = SharedCounters()
        self.unavailable = None
        try:
            self.store = open_store(backend, **kwargs)
        except (ValueError, TypeError):
            raise
        except Exception as e:
            self.store, self.unavailable = None, f"{type(e).__name__}: {e}"
            self.counters.error(e)
            warnings.warn(f"autopatch: the {backend_name(backend)} cache is unavailable, samples are "
                          f"computed: {self.unavailable}", RuntimeWarning, stacklevel=2)
        self.guard = StoreGuard(self.store, self.counters)
        self._pid, self._pending = None, {}

    def __getstate__(self):
        return dict(self.__dict__, _pid=None, _pending={})

    def _buffer(self):
        """This process's writes waiting for the next mset."""
        if self._pid != os.getpid():
            self._pid, self._pending = os.getpid(), {}
            at_exit(self.flush)
        return self._pending

    def key(self, key):
        return f"{self.dataset_name}_{key}"

    def get(self, key, load_fn):
        """The cached value of ``key``, or ``load_fn(key)``, which is then cached."""
        return self.get_many([key], lambda keys: [load_fn(keys[0])])[0]

    def get_many(self, keys, load_many):
        """The values of ``keys`` with one read of the store; ``load_many(missing_keys)`` returns
        the values of those not cached, in order."""
        names = [self.key(k) for k in keys]
        pending = self._buffer()
        stored = [pending.get(n) for n in names]
        absent = [i for i, v in enumerate(stored) if v is None]
        for i, v in zip(absent, self.guard.mget([names[i] for i in absent]) if absent else []):
            stored[i] = v
        values = [self._decode(v) for v in stored]
        missing = [i for i, v in enumerate(values) if v is _MISS]
        if missing:
            for i, v in zip(missing, load_many([keys[i] for i in missing])):
                values[i] = v
                self._write(names[i], v)
        computed = set(missing)
        read = sum(len(v) for i, v in enumerate(stored) if i not in computed)
        self.counters.add(hits=len(keys) - len(missing), misses=len(missing), bytes_read=read)
        return values

    def _decode(self, raw):
        if raw is None or not raw.startswith(self.stamp):
            return _MISS
        try:
            return decode(memoryview(raw)[len(self.stamp):])
        except (pickle.UnpicklingError, AttributeError, ImportError, EOFError, ValueError, TypeError) as e:
            self.counters.error(e)   # written by another version of the code: recompute it
            return _MISS

    def _write(self, name, value):
        try:
            data = self.stamp + encode(value)
        except Unstorable as e:
            self.counters.error(e)
            return
        pending = self._buffer()
        pending[name] = data
        if len(pending) >= self.writer_buffer_size:
            self.flush()

    def flush(self):
        """Write the waiting batch now (a failed write is dropped, never raised)."""
        pending = self._buffer()
        if pending:
            size = sum(map(len, pending.values()))
            if self.guard.mset(pending):
                self.counters.add(bytes_written=size, writes=len(pending))
            pending.clear()
        self.counters.flush()

    def prime(self, encoded):
        """Store already encoded values ({key: bytes from sample_codec.encode}) now."""
        pending = self._buffer()
        pending.update({self.key(k): self.stamp + v for k, v in encoded.items()})
        self.flush()

    def peek(self, keys):
        """The cached values of ``keys`` (None where not cached), computing and counting nothing."""
        return [None if v is _MISS else v
                for v in map(self._decode, self.guard.mget([self.key(k) for k in keys]))]

    @property
    def last_error(self):
        """The latest store error of any process using this loader, or None."""
        return self.counters.totals().get("last_error")

    def num_keys(self):
        """The number of entries in the store (every dataset's), 0 without a store."""
        return 0 if self.store is None else self.store.num_keys()

    def describe(self):
        """Counts of every process so far (workers included) and the store's state."""
        self.flush()
        t = self.counters.totals()
        out = {"backend": backend_name(self.backend), "dataset_name": self.dataset_name,
               **{k: t.get(k, 0) for k in ("hits", "misses", "bytes_read", "bytes_written", "writes", "errors")}}
        if t.get("last_error"):
            out["last_error"] = t["last_error"]
        if self.unavailable:
            out["unavailable"] = self.unavailable
        return out
