"""Counters that add up across the DataLoader's worker processes.

Worker processes serve most samples, so the figures the report needs are theirs. Each process
appends its increments to one file as a short line (``O_APPEND`` writes of one line land whole),
at most twice a second and when it exits; the process that created the counters sums the lines.
Plain files work the same whether the workers were forked or spawned.
"""

import json
import os
import tempfile
import time
from collections import Counter

from .process_exit import at_exit

__all__ = ["SharedCounters"]

FLUSH_SECONDS = 0.5


class SharedCounters:
    def __init__(self):
        fd, self.path = tempfile.mkstemp(prefix="autopatch-data-", suffix=".counts")
        os.close(fd)
        self._owner = os.getpid()
        self._final = None
        self._reset()
        at_exit(self.close)

    def _reset(self):
        self._pid = os.getpid()
        self._pending = Counter()
        self._last_error = None
        self._flushed_at = time.monotonic()
        if self._pid != self._owner:   # a worker: its share is written when it exits
            at_exit(self.flush)

    def __getstate__(self):
        return {"path": self.path, "_owner": self._owner, "_final": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset()

    def add(self, **increments):
        if os.getpid() != self._pid:   # a forked worker starts without its parent's pending counts
            self._reset()
        self._pending.update(increments)
        if time.monotonic() - self._flushed_at > FLUSH_SECONDS:
            self.flush()

    def error(self, exc):
        self._last_error = f"{type(exc).__name__}: {exc}"[:300]
        self.add(errors=1)

    def flush(self):
        if (os.getpid() != self._pid or self._final is not None
                or not (self._pending or self._last_error)):
            return
        line = dict(self._pending, **({"last_error": self._last_error} if self._last_error else {}))
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError:
            return   # the owner has closed the counters; what is left is lost, never raised
        self._pending.clear()
        self._last_error = None
        self._flushed_at = time.monotonic()

    def totals(self):
        """Every process's counts so far, and the latest error message (or None)."""
        if self._final is not None:
            return dict(self._final)
        self.flush()
        total, last_error = Counter(), None
        try:
            with open(self.path) as f:
                for line in f:
                    entry = json.loads(line)
                    last_error = entry.pop("last_error", last_error)
                    total.update(entry)
        except (OSError, ValueError):
            pass
        return {**total, "last_error": last_error}

    def close(self):
        """Keep the totals and remove the file (the creating process, at exit)."""
        if os.getpid() == self._owner and self._final is None:
            self._final = self.totals()
            try:
                os.unlink(self.path)
            except OSError:
                pass
