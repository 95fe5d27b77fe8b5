"""A store whose failures never reach training.

An error (a dead server, a full disk, a refused connection) is counted, and the store is left
alone for a back-off that starts at one second and doubles up to a minute, then tried again.
Meanwhile reads are misses and writes are dropped, so samples are computed as without a cache.
Each process keeps its own back-off: DataLoader workers find out on their own.
"""

import os
import time

__all__ = ["StoreGuard"]

FIRST_BACKOFF = 1.0
MAX_BACKOFF = 60.0


class StoreGuard:
    def __init__(self, store, counters):
        self.store = store
        self.counters = counters
        self._reset()

    def _reset(self):
        self._pid = os.getpid()
        self._retry_at = 0.0
        self._backoff = FIRST_BACKOFF

    def __getstate__(self):
        return {"store": self.store, "counters": self.counters}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset()

    def _usable(self):
        if os.getpid() != self._pid:   # a forked worker tries the store afresh
            self._reset()
        return self.store is not None and time.monotonic() >= self._retry_at

    def _failed(self, exc):
        self.counters.error(exc)
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(MAX_BACKOFF, self._backoff * 2)

    def mget(self, keys):
        """The stored values, None where missing or while the store is failing."""
        if self._usable():
            try:
                values = self.store.mget(keys)
            except Exception as e:
                self._failed(e)
            else:
                self._backoff = FIRST_BACKOFF
                return values
        return [None] * len(keys)

    def mset(self, mapping):
        """True when written; False when dropped."""
        return self.call("mset", mapping)

    def call(self, method, *args):
        """``store.method(*args)``: True when done; False when it failed or the store is resting."""
        if self._usable():
            try:
                getattr(self.store, method)(*args)
            except Exception as e:
                self._failed(e)
            else:
                self._backoff = FIRST_BACKOFF
                return True
        return False
