"""Bagua's ``CacheLoader``: what an expensive function returns, kept in a store by key.

An entry's key is ``"{dataset_name}_{key}"``; its value is the encoded value (``sample_codec``, no
pickle) sealed by ``entry_seal``: a stamp, and a MAC under the user's key over the name, the stamp
and the value. The stamp is the caller's (``CachedDataset`` gives its dataset's signature, so an
entry of another version of the dataset is a miss, never a wrong sample) plus the number of torch
threads of the process that loads: DataLoader workers run one thread, the main process several,
and reductions or FFTs round differently with them, so an entry is only served where it would
have been loaded the same way. An entry that fails its MAC (damaged, cut, moved to another key,
written by someone without the key) is rejected and counted, never decoded.

Misses are computed by the caller's function and written back in batches of
``writer_buffer_size`` with one ``mset``; a smaller batch goes within a second, on an all-hit read,
before the store's keys are counted and at exit (``write_buffer``), so other processes see every
entry. Store errors are misses and dropped writes (``store_guard``).
"""

import warnings

import torch

from ...job_store import first_answer
from ..store.backends import backend_name, is_redis, open_store
from ..store.entry_seal import DAMAGED, STALE, Seal
from ..store.sample_codec import Unstorable, decode, encode
from ..store.store_guard import StoreGuard
from ..store.user_key import derived, fingerprint
from ..store.write_buffer import WriteBuffer
from .shared_counters import SharedCounters

__all__ = ["CacheLoader"]

_MISS = object()


class CacheLoader:
    def __init__(self, backend="local", dataset_name="", writer_buffer_size=1, stamp=b"", **kwargs):
        """``backend``: ``"local"`` (node-local lmdb), ``"redis"`` (a server per node) or
        ``redis://host:port`` URLs; ``kwargs`` go to the store (see ``backends.open_store``). A
        store that cannot be opened (no redis-server, an unwritable directory, no usable key) is
        reported and warned about, and every sample is then computed."""
        self.backend = backend
        self.dataset_name = dataset_name
        self.writer_buffer_size = max(1, int(writer_buffer_size))
        self.stamp = bytes(stamp)
        self.counters = SharedCounters()
        self.unavailable = None
        self.store, self.seal = None, None
        try:
            self.seal = Seal(derived("entries"))
            if is_redis(backend):
                _check_same_key()
            self.store = open_store(backend, **kwargs)
        except (ValueError, TypeError):
            raise
        except Exception as e:
            self.unavailable = f"{type(e).__name__}: {e}"
            self.counters.error(e)
            warnings.warn(f"autopatch: the {backend_name(backend)} cache is unavailable, samples are "
                          f"computed: {self.unavailable}", RuntimeWarning, stacklevel=2)
        self.guard = StoreGuard(self.store, self.counters)
        self.writes = WriteBuffer(self.writer_buffer_size, self._send)

    def key(self, key):
        return f"{self.dataset_name}_{key}"

    def stamp_here(self, threads=None):
        """The stamp of entries loaded in this process (or with ``threads`` torch threads)."""
        return self.stamp + b"/t%d" % (threads or torch.get_num_threads())

    def get(self, key, load_fn):
        """The cached value of ``key``, or ``load_fn(key)``, which is then cached."""
        return self.get_many([key], lambda keys: [load_fn(keys[0])])[0]

    def get_many(self, keys, load_many):
        """The values of ``keys`` with one read of the store; ``load_many(missing_keys)`` returns
        the values of those not cached, in order."""
        names = [self.key(k) for k in keys]
        stamp = self.stamp_here()
        stored = self._read(names)
        values = [self._decode(self._open(n, stamp, v)) for n, v in zip(names, stored)]
        missing = [i for i, v in enumerate(values) if v is _MISS]
        if not missing:   # the store has caught up with this process: what it still holds goes now
            self.writes.flush()
        else:
            for i, v in zip(missing, load_many([keys[i] for i in missing])):
                values[i] = v
                self._write(names[i], stamp, v)
        computed = set(missing)
        read = sum(len(v) for i, v in enumerate(stored) if i not in computed)
        self.counters.add(hits=len(keys) - len(missing), misses=len(missing), bytes_read=read)
        return values

    def _read(self, names):
        with self.writes.lock:
            stored = [self.writes.get(n) for n in names]
            absent = [i for i, v in enumerate(stored) if v is None]
            for i, v in zip(absent, self.guard.mget([names[i] for i in absent]) if absent else []):
                stored[i] = v
        return stored

    def _open(self, name, stamp, raw):
        """The payload of a stored entry, or _MISS (absent, another version's, or rejected)."""
        if raw is None or self.seal is None:
            return _MISS
        payload = self.seal.open(name.encode(), stamp, raw)
        if payload is DAMAGED:
            self.counters.add(rejected=1)
            self.counters.error(f"entry {name} failed its integrity check and was loaded instead")
            return _MISS
        return _MISS if payload is STALE else payload

    def _decode(self, payload):
        if payload is _MISS:
            return _MISS
        try:
            return decode(payload)
        except Exception as e:   # sealed by this user but not decodable here: another version of the code
            self.counters.error(e)
            return _MISS

    def _write(self, name, stamp, value):
        if self.seal is None:
            return
        try:
            data = self.seal.close(name.encode(), stamp, encode(value))
        except Unstorable as e:
            self.counters.error(e)
            return
        self.writes.add(name, data)

    def _send(self, items):
        """One batch of writes to the store (a failed write is dropped, never raised)."""
        if self.guard.mset(items):
            self.counters.add(bytes_written=sum(map(len, items.values())), writes=len(items))
        self.counters.flush()

    def flush(self):
        """Write the waiting batch now."""
        self.writes.flush()
        self.counters.flush()

    def put_encoded(self, encoded, threads=None):
        """Store already encoded values ({key: bytes from sample_codec.encode}) now, stamped as
        loaded with ``threads`` torch threads (this process's by default). True when written."""
        if self.seal is None:
            return False
        stamp = self.stamp_here(threads)
        entries = {self.key(k): self.seal.close(self.key(k).encode(), stamp, v) for k, v in encoded.items()}
        with self.writes.lock:
            return self.guard.mset(entries)

    def peek_encoded(self, keys, threads=None):
        """The stored payloads of ``keys`` (bytes; None where not cached) for entries loaded with
        ``threads`` torch threads, decoding and counting nothing."""
        names = [self.key(k) for k in keys]
        stamp = self.stamp_here(threads)
        with self.writes.lock:
            stored = self.guard.mget(names)
        return [None if p is _MISS else bytes(p) for p in (self._open(n, stamp, v) for n, v in zip(names, stored))]

    def peek(self, keys, threads=None):
        """The cached values of ``keys`` (None where not cached), counting nothing."""
        return [None if p is None else self._decode(p) for p in self.peek_encoded(keys, threads)]

    def forget(self, keys=None):
        """Delete the entries of ``keys``, or every entry of this dataset_name. True when done."""
        with self.writes.lock:
            if keys is not None:
                return self.guard.call("delete", [self.key(k) for k in keys])
            return self.guard.call("delete_prefix", self.key(""))

    @property
    def last_error(self):
        """The latest store error of any process using this loader, or None."""
        return self.counters.totals().get("last_error")

    def num_keys(self):
        """The number of entries in the store (every dataset's, this process's waiting writes
        included), 0 without a store."""
        if self.store is None:
            return 0
        self.flush()
        with self.writes.lock:
            return self.store.num_keys()

    def describe(self):
        """Counts of every process so far (workers included) and the store's state."""
        self.flush()
        t = self.counters.totals()
        out = {"backend": backend_name(self.backend), "dataset_name": self.dataset_name,
               **{k: t.get(k, 0) for k in ("hits", "misses", "bytes_read", "bytes_written", "writes", "errors",
                                            "rejected")}}
        if t.get("last_error"):
            out["last_error"] = t["last_error"]
        if self.unavailable:
            out["unavailable"] = self.unavailable
        repaired = getattr(self.store, "repaired", None)
        if repaired:
            out["repaired"] = repaired
        return out

    def close(self):
        """Write what waits, keep the counts, and let go of the store's connections and the
        counters' memory (autopatch is being disabled)."""
        self.flush()
        self.counters.close()
        if self.store is not None:
            self.store.shutdown()


def _check_same_key():
    """Ranks that share Redis servers must hold one key, or they reject each other's entries."""
    answer = first_answer("user-key", fingerprint().encode())
    if not answer.own:
        raise RuntimeError("this rank's cache key (~/.cache/autopatch/key) differs from the one other ranks of "
                           "the job hold (their home directories are not shared), so they would reject each "
                           "other's entries in the shared Redis servers; the cache stays off here")
