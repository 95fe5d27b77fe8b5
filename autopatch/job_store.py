"""What ranks tell each other through the job's store (the default process group's c10d store),
never by a collective on the user's group.

Two ways, for every room that asks:

- ``first_answer``: one answer per job with no rank waiting for another. Each rank offers its
  answer under the question's key with ``compare_set``; the first offer is kept, and every rank
  gets that one back whenever it asks. Nothing waits, so a rank that asks alone (a loader the
  other ranks never build) cannot hang. A single process keeps its own answer; so does a job
  whose store cannot be reached (``shared`` False, so the caller can say so).
- ``exchange``: a rank publishes its part (or none) and waits for every part named, bounded by
  the caller's ``seconds``; a wait that runs out raises ``StoreWaitError``, which says which rank
  waited how long for what, and what most likely happened.

Mode auto's and autotune's decisions, which a rank that stopped must be able to end, wait their
own way (agreement.py).
"""

import datetime
import time
from dataclasses import dataclass

from . import dist as _dist

__all__ = ["job_store", "first_answer", "Answer", "exchange", "StoreWaitError"]

ANSWERS = "autopatch/data/answer/"


class StoreWaitError(RuntimeError):
    """What other ranks should have published did not come: one of them most likely exited or stalled."""


@dataclass(frozen=True)
class Answer:
    value: bytes
    own: bool      # this rank's answer was the one kept
    shared: bool   # the job's answer (False: this process answered alone)


def job_store():
    """The default process group's store, or None (no process group, or torch offers none)."""
    from .torch_internals import default_store
    return default_store()


def first_answer(question, mine):
    """The job's answer to ``question`` (a key), ``mine`` (bytes) offered as this rank's."""
    if _dist.world_size() == 1:
        return Answer(mine, True, True)
    store = job_store()
    if store is None:
        return Answer(mine, True, False)
    kept = store.compare_set(ANSWERS + question, "", mine)
    return Answer(kept, kept == mine, True)


def exchange(store, keys, seconds, what, mine=None):
    """The values (bytes) under ``keys``, in order, once every one is there. ``mine``: a (key,
    value) this rank publishes first; ``seconds``: the longest it waits; ``what``: what it waits
    for, in words, for the error."""
    if mine is not None:
        store.set(*mine)
    start = time.monotonic()
    try:
        store.wait(keys, datetime.timedelta(seconds=seconds))
    except Exception as e:
        raise StoreWaitError(
            f"autopatch: rank {_dist.rank()} waited {time.monotonic() - start:.0f} s (at most {seconds} s) "
            f"for {what}: {e}. Another rank has most likely exited or stalled; its own log says which.") from e
    return [store.get(key) for key in keys]
