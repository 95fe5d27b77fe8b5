"""Sharded optimizer state for a rank that asks alone: ``state_dict()`` on rank 0 only, the way
most DDP scripts save a checkpoint, returns the whole state there as unpatched.

The broadcasts that gather the state (shard_exchange.py) need every rank at the same point; a
script that asks on rank 0 only would leave them waiting. So each ``state_dict()`` first finds
out, through the job's store, whether every rank of the group asks at the same step:

- every rank publishes that it asks (the optimizer's number in the group, the step it is at, and
  how many times it asked at that step), and waits at most ``TOGETHER_SECONDS`` for the others;
- the first rank to decide writes the decision with ``compare_set``: ``together`` only if it saw
  every rank ask, else ``served``; every asker follows the decision kept, so either all of them
  run the broadcasts or none does, however late one arrives. The keys go once they can no longer
  change a decision (a served call leaves one: its decision), so a job that checkpoints often does
  not grow the store;
- ``served``: the asker takes a ticket and publishes its request; on every rank a service thread
  (started once something is sharded) polls the ticket counter, one store round trip every
  ``POLL_SECONDS``, and answers each request for a group it is in with its part (what the
  broadcasts would have sent), read once its optimizer has ended the asker's step and is not
  inside another. That moment comes: the other ranks cannot step past it without the asker,
  whose DDP allreduce the next step needs. The asker waits at most ``WAIT_SECONDS``, and not at
  all once a rank said it stopped (agreement.py) and its service thread has ended (a rank that
  is disabling still serves while its optimizers give their state back), and raises
  ``ShardedStateError`` then.

Parts travel as ``torch.save`` bytes through the store, so a served ``state_dict()`` moves every
other rank's share through the store's server on the job's first host: slower than the broadcasts
for large states, and it never makes a rank wait for another to call something.
"""

import atexit
import io
import pickle
import threading
import time
import weakref

from .. import agreement, dist
from ..job_store import job_store

PREFIX = "autopatch/shard/"
TICKETS = PREFIX + "tickets"
TOGETHER_SECONDS = 2.0     # how long an asker waits to see whether every rank asks too
WAIT_SECONDS = 60.0        # the longest an asker waits for the parts served
POLL_SECONDS = 0.05        # how often a service thread looks for new requests


def exiting_key(rank):
    """Set once ``rank``'s process is exiting (``ShardService.at_exit``)."""
    return f"{PREFIX}exiting/{rank}"


def serving_key(rank):
    """Set while ``rank``'s service thread runs: a rank that said it stopped (agreement.py's
    ``closed``, published as ``disable()`` begins) still serves until its sharded optimizers
    have given their state back."""
    return f"{PREFIX}serving/{rank}"


class ShardedStateError(RuntimeError):
    """A sharded optimizer's whole state could not be gathered."""


def _forget(store, keys):
    for key in keys:
        try:
            store.delete_key(key)
        except Exception:     # gone with the job, or never written: nothing to keep clean
            pass


def _dumps(obj):
    import torch
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data):
    import torch
    return torch.load(io.BytesIO(data), weights_only=True)


class ShardService:
    """This process's end of the protocol: ``register`` an exchange's reader of its parts, ``ask``
    for the others'."""

    def __init__(self):
        self._readers = {}            # (group's ranks, number) -> WeakMethod of its part reader
        self._asked = {}              # (group's ranks, number, step) -> how many times this rank asked
        self._numbers = {}            # group's ranks -> the next exchange's number
        self._lock = threading.Lock()
        self._thread = None
        self._seen = 0                # the last ticket looked at
        self._serving_in = None       # the store where this rank said it serves (serving_key)
        self._said_in = None          # the last such store: at exit the group may be destroyed
        self._groups = set()          # the groups' ranks this process sharded state over
        self._kept = {}               # (group's ranks, number) -> (step, parts) of a freed optimizer
        self._stopping = False        # at exit: the service thread ends at its next poll

    def number(self, ranks):
        """The next exchange's number in the group ``ranks``: every rank makes its exchanges in the
        same order (the same script steps the same optimizers), so numbers name the same one."""
        with self._lock:
            n = self._numbers.get(ranks, 0)
            self._numbers[ranks] = n + 1
            return n

    def register(self, ranks, number, read):
        """``read(step)``, a bound method: this rank's parts as of the end of ``step`` (None while
        it is not there yet; raises when it is past it)."""
        with self._lock:
            self._readers[(ranks, number)] = weakref.WeakMethod(read)   # never keeps an optimizer alive
            self._kept = {key: v for key, v in self._kept.items() if key[0] != ranks}   # a newer one
            self._groups.add(ranks)
            self._start()

    def keep(self, ranks, number, step, parts):
        """A freed optimizer's ``parts`` as of the end of ``step`` (its reader is gone): served
        until the process exits or a newer optimizer shards over the same group, so a rank that
        saves alone after the others' optimizers went (a script's ``main()`` returned) still gets
        them. One per group: what the rank held while the optimizer lived, at most."""
        with self._lock:
            self._kept = {key: v for key, v in self._kept.items() if key[0] != ranks}
            self._kept[(ranks, number)] = (step, parts)
            self._start()

    def _start(self):
        """Say this rank serves, and run the service thread (under the lock)."""
        self._say_serving(True)
        if self._thread is None or not self._thread.is_alive():
            store = job_store()
            if store is None:
                return
            self._seen = int(store.add(TICKETS, 0))
            self._thread = threading.Thread(target=self._serve, args=(store,), daemon=True,
                                            name="autopatch-shard-service")
            self._thread.start()

    def _say_serving(self, serving):
        """Publish (or take back) that this rank serves: from the threads that register and
        unregister readers, and at exit; never from the service thread, which may still run
        while the interpreter tears the store down."""
        if serving == (self._serving_in is not None):
            return
        store = job_store() if serving else self._serving_in
        if store is None:
            return
        if serving:
            store.set(serving_key(dist.rank()), b"1")
            self._serving_in = self._said_in = store
        else:
            _forget(store, [serving_key(dist.rank())])
            self._serving_in = None

    def at_exit(self):
        """At exit, a rank of a group that sharded state says so and, while it still serves,
        goes on serving until every other rank of those groups is exiting too, at most
        ``WAIT_SECONDS``: the usual last checkpoint, ``state_dict()`` on rank 0 after the last
        step, needs the others' shares after they have left their loops. Then the service thread
        ends, before the interpreter tears the store down under it."""
        try:
            store = self._said_in
            if store is None:
                return
            me = dist.rank()
            store.set(exiting_key(me), b"1")
            others = {r for ranks in self._groups for r in ranks if r != me}
            deadline = time.monotonic() + WAIT_SECONDS
            while self._serving_in is not None and others and time.monotonic() < deadline:
                time.sleep(POLL_SECONDS)
                others = {r for r in others if not store.check([exiting_key(r)])}
            self._stopping = True
            thread = self._thread
            if thread is not None:
                thread.join(timeout=1.0)
            with self._lock:
                self._say_serving(False)
        except Exception:       # the job's store or group went first: nobody is left to tell
            pass

    def unregister(self, ranks, number, read):
        with self._lock:
            ref = self._readers.get((ranks, number))
            if ref is not None and ref() in (None, read):
                del self._readers[(ranks, number)]
            if not self._kept and not any(ref() is not None for ref in self._readers.values()):
                self._say_serving(False)

    # -- the asking rank --------------------------------------------------------------------------
    def together(self, ranks, number, step, what):
        """True when every rank of the group asks for ``what`` at ``step`` (then the broadcasts
        gather it), False when this rank is to be served."""
        store = job_store()
        if store is None:
            raise ShardedStateError(f"{what}: the job's store cannot be reached to gather the sharded state")
        key = (ranks, number, step)
        call = self._asked.get(key, 0)
        self._asked[key] = call + 1
        base = f"{PREFIX}{'.'.join(map(str, ranks))}/{number}/{step}/{call}"
        me, how = dist.rank(), f"{base}/how"
        asks = {r: f"{base}/ask/{r}" for r in ranks}
        store.set(asks[me], b"1")
        others = [key for r, key in asks.items() if r != me]
        deadline = time.monotonic() + TOGETHER_SECONDS
        while not store.check(others) and not store.check([how]) and time.monotonic() < deadline:
            time.sleep(0.005)
        kept = store.compare_set(how, "", b"together" if store.check(others) else b"served")
        # The decision is kept and cannot change, so the keys go: an asker's own at once when it
        # is served (no rank can then see every rank ask), every key once all ranks read
        # ``together``. A served call leaves its decision, for an asker of that step still to come.
        if kept != b"together":
            _forget(store, [asks[me]])
            return False
        if int(store.add(f"{base}/read", 1)) == len(ranks):
            _forget(store, [*asks.values(), how, f"{base}/read"])
        return True

    def served(self, ranks, number, step, what):
        """Every other rank's parts, served: ``{rank: parts}``."""
        store = job_store()
        me = dist.rank()
        ticket = int(store.add(TICKETS, 1))
        store.set(f"{PREFIX}request/{ticket}", pickle.dumps((me, ranks, number, step)))
        replies = {r: f"{PREFIX}reply/{ticket}/{r}" for r in ranks if r != me}
        parts, deadline, pause = {}, time.monotonic() + WAIT_SECONDS, 0.001
        try:
            while len(parts) < len(replies):
                for r, key in replies.items():
                    if r not in parts and store.check([key]):
                        ok, body = pickle.loads(store.get(key))
                        if not ok:
                            raise ShardedStateError(f"{what}: rank {r} could not serve its share ({body})")
                        parts[r] = _loads(body)
                if len(parts) == len(replies):
                    break
                waiting = [r for r in replies if r not in parts]
                if any(store.check([agreement.closed_key(r)]) and not store.check([serving_key(r)])
                       for r in waiting):
                    raise ShardedStateError(f"{what}: rank(s) {waiting} stopped (autopatch disabled or the "
                                            "process ended) before serving their share of the state")
                if time.monotonic() > deadline:
                    raise ShardedStateError(
                        f"{what}: rank(s) {waiting} did not serve their share of the state within "
                        f"{WAIT_SECONDS:.0f} s (a rank stepped without this one, or stalled)")
                time.sleep(pause)
                pause = min(2 * pause, 0.02)
        finally:
            _forget(store, [f"{PREFIX}request/{ticket}", *replies.values()])
        return parts

    # -- every rank: the service thread -----------------------------------------------------------
    def _serve(self, store):
        me = dist.rank()
        while True:
            with self._lock:
                for key in [k for k, ref in self._readers.items() if ref() is None]:
                    del self._readers[key]          # optimizers freed
                if (not self._readers and not self._kept) or self._stopping:
                    self._thread = None
                    return
            try:
                last = int(store.add(TICKETS, 0))
                for ticket in range(self._seen + 1, last + 1):
                    self._answer(store, ticket, me)
                self._seen = max(self._seen, last)
            except Exception:       # the store went with the job: nothing is left to serve
                with self._lock:
                    self._thread = None
                return
            time.sleep(POLL_SECONDS)

    def _answer(self, store, ticket, me):
        key = f"{PREFIX}request/{ticket}"
        deadline = time.monotonic() + WAIT_SECONDS
        while not store.check([key]):         # the asker took the ticket a moment before
            if time.monotonic() > deadline:
                return
            time.sleep(0.001)
        asker, ranks, number, step = pickle.loads(store.get(key))
        if asker == me or me not in ranks:
            return
        try:
            body = (True, _dumps(self._read(ranks, number, step, deadline)))
        except Exception as e:
            body = (False, f"{type(e).__name__}: {e}")
        store.set(f"{PREFIX}reply/{ticket}/{me}", pickle.dumps(body))

    def _read(self, ranks, number, step, deadline):
        while True:
            with self._lock:
                ref = self._readers.get((ranks, number))
                kept = self._kept.get((ranks, number))
            read = None if ref is None else ref()
            if read is None and kept is not None:
                if kept[0] != step:
                    raise ShardedStateError(f"rank {dist.rank()} kept the state of sharded step {kept[0]} "
                                            f"of a freed optimizer, not of step {step}")
                return kept[1]
            if read is None:
                raise ShardedStateError(f"rank {dist.rank()} shards no such optimizer any more "
                                        "(autopatch was disabled there, or it left sharding)")
            parts = read(step)
            if parts is not None:
                return parts
            if time.monotonic() > deadline:
                raise ShardedStateError(f"rank {dist.rank()} did not reach the end of step {step}")
            time.sleep(0.002)


SERVICE = ShardService()


atexit.register(SERVICE.at_exit)
