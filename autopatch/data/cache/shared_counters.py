"""Counters that add up across the DataLoader's worker processes, leaving nothing behind.

Worker processes serve most samples, so the figures the report needs are theirs. The counters
live in a few hundred bytes of memory shared by the process that made them and its workers: an
anonymous memory file (``memfd``; where there is none, an unnamed temporary file), which has no
name in any directory, so a killed job leaves nothing, and which forked workers inherit and
spawned ones receive as a file descriptor. Each process adds its increments under a POSIX record
lock at most twice a second and when it exits. ``close`` (the making process, at ``disable()``
or exit) keeps the totals and releases the memory.
"""

import contextlib
import fcntl
import mmap
import multiprocessing.context
import multiprocessing.reduction
import os
import struct
import tempfile
import threading
import time
import weakref
from collections import Counter

from ..store.process_exit import at_exit

__all__ = ["SharedCounters", "COUNTS"]

COUNTS = ("hits", "misses", "bytes_read", "bytes_written", "writes", "errors", "rejected")
ERROR_BYTES = 400
_LAYOUT = struct.Struct(f"<{len(COUNTS)}qH")
SIZE = _LAYOUT.size + ERROR_BYTES
FLUSH_SECONDS = 0.5


def _memory_file():
    try:
        fd = os.memfd_create("autopatch-data-counts", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        with tempfile.TemporaryFile() as f:   # O_TMPFILE, or unlinked at once
            fd = os.dup(f.fileno())
    os.ftruncate(fd, SIZE)
    return fd


def _release(memory, fd):
    memory.close()
    os.close(fd)


class SharedCounters:
    def __init__(self, fd=None):
        """``fd``: the memory of counters made in another process (a spawned worker)."""
        self._fd = _memory_file() if fd is None else fd
        self._memory = mmap.mmap(self._fd, SIZE)
        self._owner = os.getpid() if fd is None else None
        self._final = None
        self._thread_lock = threading.Lock()
        self._release = weakref.finalize(self, _release, self._memory, self._fd)
        self._reset()
        if fd is None:
            ref = weakref.ref(self)
            at_exit(lambda: ref() is not None and ref().close())

    def _reset(self):
        self._pid = os.getpid()
        self._pending = Counter()
        self._last_error = None
        self._flushed_at = time.monotonic()
        if self._pid != self._owner:   # a worker: its share is added when it exits
            ref = weakref.ref(self)
            at_exit(lambda: ref() is not None and ref().flush())

    def __reduce__(self):
        """Spawned workers get the memory itself; any other copy (deepcopy, pickling for another
        machine) gets counters of its own."""
        if multiprocessing.context.get_spawning_popen() is not None:
            return _attach, (multiprocessing.reduction.DupFd(self._fd),)
        return SharedCounters, ()

    def add(self, **increments):
        if os.getpid() != self._pid:   # a forked worker starts without its parent's pending counts
            self._reset()
        self._pending.update(increments)
        if time.monotonic() - self._flushed_at > FLUSH_SECONDS:
            self.flush()

    def error(self, exc):
        self._last_error = (exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}")[:300]
        self.add(errors=1)

    def flush(self):
        if (os.getpid() != self._pid or self._final is not None or self._memory.closed
                or not (self._pending or self._last_error)):
            return
        with self._locked():
            values = list(_LAYOUT.unpack_from(self._memory))
            for i, k in enumerate(COUNTS):
                values[i] += self._pending.get(k, 0)
            if self._last_error:
                text = self._last_error.encode()[:ERROR_BYTES]
                values[-1] = len(text)
                self._memory[_LAYOUT.size:_LAYOUT.size + len(text)] = text
            _LAYOUT.pack_into(self._memory, 0, *values)
        self._pending.clear()
        self._last_error = None
        self._flushed_at = time.monotonic()

    @contextlib.contextmanager
    def _locked(self):
        with self._thread_lock:
            fcntl.lockf(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def totals(self):
        """Every process's counts so far, and the latest error message (or None)."""
        if self._final is not None:
            return dict(self._final)
        self.flush()
        with self._locked():
            values = _LAYOUT.unpack_from(self._memory)
            error = bytes(self._memory[_LAYOUT.size:_LAYOUT.size + values[-1]]).decode(errors="replace")
        return {**dict(zip(COUNTS, values)), "last_error": error or None}

    def close(self):
        """Keep the totals and release the shared memory (the making process)."""
        if os.getpid() == self._owner and self._final is None:
            self._final = self.totals()
            self._release()


def _attach(dup_fd):
    return SharedCounters(fd=dup_fd.detach())
