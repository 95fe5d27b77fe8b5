"""Waiting on collectives: bounded, counted, cancellable, and in the order every rank shares.

Every wait of the communication room goes through a ``Waiter``: it bounds the wait by a timeout
(None: the process group's own), counts the seconds spent, and turns a failure into a
``CommunicationError`` that says which rank waited for what, how long, and what most likely
happened. Given ``cancelled``, it polls instead of blocking, so a background thread gives up as
soon as torch.distributed is shut down under it (such a wait would ignore its timeout).

A reduction that takes several collectives is a generator of *stages*: it issues a collective
with ``async_op=True``, yields its work, and goes on once the caller has waited for it.
``drain`` runs many such generators stage by stage, in list order, so that every rank issues the
same collectives in the same order on every group.
"""

import collections
import datetime
import time

import torch.distributed as dist

from ..running_totals import TOTALS


class CommunicationError(RuntimeError):
    """A collective failed or timed out: another rank most likely exited or stalled."""


class Waiter:
    def __init__(self, timeout, who, context=None):
        """``timeout``: seconds, a ``timedelta``, or None (the process group's own timeout);
        ``who``: named in errors; ``context()``: more words for an error (the step, say)."""
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            timeout = datetime.timedelta(seconds=timeout)
        self.timeout = timeout
        self.who = who
        self.context = context
        self.seconds = 0.0

    def waited(self, seconds):
        """Count ``seconds`` spent waiting on something other than a collective (a peer thread)."""
        self.seconds += seconds
        TOTALS.comm += seconds

    def wait(self, work, what, cancelled=None):
        """``work``: one work object or a list of them (``batch_isend_irecv``'s answer)."""
        start = time.perf_counter()
        try:
            for w in work if isinstance(work, list) else [work]:
                if cancelled is not None:
                    self._poll(w, start, cancelled)
                if self.timeout is None:
                    w.wait()
                else:
                    w.wait(self.timeout)
        except Exception as e:
            raise self._failure(what, start, e) from e
        finally:
            waited = time.perf_counter() - start
            self.seconds += waited
            TOTALS.comm += waited

    def _failure(self, what, start, e):
        where = f" ({self.context()})" if self.context is not None else ""
        return CommunicationError(
            f"autopatch {self.who}: {what} failed on rank {dist.get_rank()} after "
            f"{time.perf_counter() - start:.1f} s{where}: {e}. Another rank has most likely exited, "
            "stalled, or is running different code; its own log says which.")

    def _poll(self, work, start, cancelled):
        pause = 1e-4
        limit = None if self.timeout is None else self.timeout.total_seconds()
        while not work.is_completed():
            if cancelled():
                raise RuntimeError("torch.distributed was shut down while it was under way")
            if limit is not None and time.perf_counter() - start > limit:
                raise RuntimeError(f"timed out after {limit:.0f} s")
            time.sleep(pause)
            pause = min(2 * pause, 0.01)

    def drain(self, pending, what, done=None):
        """Run stage generators to their end. ``pending``: (stages, the work issued last, tag)
        triples, in the order every rank issued them; each is waited for stage by stage in that
        order, and ``done(tag)`` runs as soon as one has no stage left."""
        queue = collections.deque(pending)
        while queue:
            later = collections.deque()
            while queue:     # popped, so a finished reduction's work (which holds its buffer) is let go
                stages, work, tag = queue.popleft()
                if work is not None:
                    self.wait(work, what(tag) if callable(what) else what)
                    work = next(stages, None)
                if work is not None:
                    later.append((stages, work, tag))
                elif done is not None:
                    done(tag)
            queue = later


def start(stages, tag=None):
    """Issue a stage generator's first collective: ``(stages, work, tag)`` for ``Waiter.drain``
    (``work`` is None when there was nothing to issue)."""
    return stages, next(stages, None), tag
