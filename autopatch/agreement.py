"""Decisions shared across ranks through the job's store, never by a collective on the user's group.

A collective that autopatch adds to the user's process group must be joined by every rank at the
same point, so ranks that step unevenly (the async algorithm, DDP's ``join()``, a rank that stops
early) would hang in it. Mode auto's race and autotune need every rank to follow one decision, so
instead the first rank of the group *publishes* each decision under a numbered key of the default
process group's store and goes on at once; another rank reads it when it gets to the same point.
Only a rank that gets there first waits, and never unboundedly: at most ``WAIT_SECONDS``, and not
at all once the rank it waits for has said it stopped (``disable()`` or exit publish that). A wait
that cannot end raises ``AgreementLost``, and the caller goes on alone (auto unpatched, autotune
frozen), saying why: the user's program never waits on autopatch for a rank that will not come.

Calls are numbered per group, so every rank must make the same sequence of calls on a group, as it
would have to for collectives; each record names its topic, and a rank that reads another topic
than it asked for (ranks that adopted different optimizers) gets ``AgreementLost`` too.
"""

import atexit
import pickle
import time

from . import dist
from .job_store import job_store

PREFIX = "autopatch/agree/"
WAIT_SECONDS = 60.0      # the longest a rank waits for a decision (ranks in step wait one step)
_POLL_FIRST, _POLL_MOST = 50e-6, 0.01

_generations = {}        # default process group id -> its generation in this process
_counters = {}           # (generation, group's ranks) -> the next call's number
_closed = []             # this process published that it stopped
_used = {}               # the store and this rank, once used: exit can still say it stopped


class AgreementLost(RuntimeError):
    """Another rank's part of an agreement will not come (it stopped, exited, or went elsewhere)."""


def _store():
    store = job_store()
    if store is not None:
        _used.update(store=store, rank=dist.rank())
    return store


def _ranks(group):
    import torch.distributed as torch_dist
    return tuple(torch_dist.get_process_group_ranks(group)) if group is not None else \
        tuple(range(torch_dist.get_world_size()))


def closed_key(rank):
    """The key under which ``rank`` says it stopped (shard_service.py's waits read it too)."""
    return f"{PREFIX}closed/{rank}"


def _next_key(ranks):
    """The key prefix of this group's next call. A process group set up again in the same
    process starts a generation of its own (every rank sets it up again alike); torchrun's
    restarts get a store prefix of their own."""
    generation = _generations.setdefault(dist.default_group_id(), len(_generations))
    counter = (generation, ranks)
    n = _counters.get(counter, 0)
    _counters[counter] = n + 1
    return f"{PREFIX}{generation}/{'.'.join(map(str, ranks))}/{n}"


def _single(group):
    return dist.world_size() < 2 or len(_ranks(group)) < 2


def agree(topic, decision, group=None):
    """The group's first rank's ``decision`` (any picklable object) on every rank of ``group``
    (None: the world); the other ranks' ``decision`` is not used."""
    if _single(group):
        return decision
    ranks = _ranks(group)
    key = _next_key(ranks)
    store = _store()
    if dist.rank() == ranks[0]:
        store.set(key, pickle.dumps((topic, decision)))
        return decision
    return _read(store, key, topic, ranks[0])


def gather(topic, value, group=None):
    """Every rank's ``value`` (picklable), in the group's rank order, on every rank of ``group``."""
    if _single(group):
        return [value]
    ranks = _ranks(group)
    key = _next_key(ranks)
    store = _store()
    me = dist.rank()
    store.set(f"{key}/{me}", pickle.dumps((topic, value)))
    return [value if r == me else _read(store, f"{key}/{r}", topic, r) for r in ranks]


def _read(store, key, topic, owner):
    """The record under ``key`` that rank ``owner`` publishes: polled, so that a rank that said it
    stopped ends the wait, and bounded by ``WAIT_SECONDS``."""
    deadline = time.monotonic() + WAIT_SECONDS
    pause = _POLL_FIRST
    while not store.check([key]):
        if store.check([closed_key(owner)]):
            raise AgreementLost(f"rank {owner} stopped (autopatch disabled or the process ended) "
                                f"before deciding {topic}")
        if time.monotonic() > deadline:
            raise AgreementLost(f"rank {owner} did not decide {topic} within {WAIT_SECONDS:.0f} s "
                                "(its steps are far behind this rank's, or it stopped)")
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MOST)
    their_topic, value = pickle.loads(store.get(key))
    if their_topic != topic:
        raise AgreementLost(f"rank {owner} decided {their_topic} where this rank decides {topic} "
                            "(the ranks adopted different optimizers)")
    return value


def opened():
    """autopatch is enabled in this process: another rank's waits for it wait again."""
    if _closed and _used:
        try:
            _used["store"].delete_key(closed_key(_used["rank"]))
        except Exception:
            pass
    _closed.clear()


def closed():
    """autopatch stops in this process (``disable()``, exit): ranks waiting for it stop waiting.
    The store last used serves when the process group is already destroyed. Never raises: the
    store may be gone with the job."""
    if _closed or not _used:
        return
    _closed.append(True)
    try:
        _used["store"].set(closed_key(_used["rank"]), b"1")
    except Exception:
        pass


atexit.register(closed)
