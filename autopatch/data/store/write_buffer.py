"""Writes waiting to go to the store together, and when they go.

A batch of ``size`` goes at once. A smaller one goes when its oldest write is ``max_age`` seconds
old (a timer thread: a process that stops writing, such as a persistent DataLoader worker whose
last batch was partial, does not keep its writes from other processes), when the owner asks (an
all-hit read, a count of the store's keys, close) and when the process exits. Each process
(DataLoader workers are forked or spawned) has its own batch, lock and timer; a fork waits for a
timer's write to end (``hold_all``: ``local_store`` closes its lmdb environments just before it).
"""

import os
import threading
import time
import weakref

from .process_exit import at_exit

__all__ = ["WriteBuffer", "MAX_AGE", "hold_all", "release_all", "forget_held"]

MAX_AGE = 1.0
_live = weakref.WeakSet()   # this process's buffers, held across a fork
_held = []


class WriteBuffer:
    def __init__(self, size, send, max_age=MAX_AGE):
        """``send(items)`` writes a batch ({key: value}) and never raises."""
        self.size, self.send, self.max_age = max(1, int(size)), send, max_age
        self._pid = None

    def __getstate__(self):
        return {"size": self.size, "send": self.send, "max_age": self.max_age, "_pid": None}

    @property
    def lock(self):
        """Held while this process's batch or the store is in use, so the timer's write never
        runs beside the owner's reads and writes. A new process starts with a batch and lock of
        its own (the parent's lock may have been held by its timer at the fork)."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._items, self._since, self._timer = {}, None, None
            self._lock = threading.RLock()
            _live.add(self)
            ref = weakref.ref(self)
            at_exit(lambda: ref() is not None and ref().flush())
        return self._lock

    def get(self, key):
        """The value waiting for ``key``, or None."""
        with self.lock:
            return self._items.get(key)

    def __len__(self):
        with self.lock:
            return len(self._items)

    def add(self, key, value):
        with self.lock:
            self._items[key] = value
            if self._since is None:
                self._since = time.monotonic()
            if len(self._items) >= self.size or time.monotonic() - self._since >= self.max_age:
                self._flush()
            elif self._timer is None:
                self._arm(self.max_age)

    def flush(self):
        with self.lock:
            self._flush()

    def _flush(self):
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        items, self._items, self._since = self._items, {}, None
        if items:
            self.send(items)

    def _arm(self, delay):
        self._timer = threading.Timer(delay, self._on_timer)
        self._timer.daemon = True
        self._timer.start()

    def _on_timer(self):
        with self.lock:
            if threading.current_thread() is not self._timer:
                return   # flushed (and maybe re-armed) since this timer was started
            self._timer = None
            if self._since is not None:
                wait = self._since + self.max_age - time.monotonic()
                if wait > 0:
                    self._arm(wait)
                else:
                    self._flush()

    def hold(self):
        """Take this process's lock (before a fork); True when taken."""
        if self._pid != os.getpid():
            return False
        self._lock.acquire()
        return True

    def release(self):
        self._lock.release()


def hold_all():
    """Before a fork: wait for any timer's write to end and keep new ones from starting, so the
    store can be closed under no one (``local_store`` closes its lmdb environments)."""
    _held[:] = [b for b in list(_live) if b.hold()]


def release_all():
    """After a fork, in the parent."""
    while _held:
        _held.pop().release()


def forget_held():
    """After a fork, in the child: its buffers start afresh with locks of their own."""
    _held.clear()
