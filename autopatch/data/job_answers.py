"""One answer per job, with no rank waiting for another: the first rank to answer decides for all.

Some questions each rank answers from what it measured or loaded (does the cache pay, what each
sample costs, which key the user holds), and the job needs one answer to them. Each rank offers
its answer under the question's key in the default process group's store, with ``compare_set``:
the first offer is kept, and every rank gets that one back whenever it asks. Nothing waits, so a
rank that asks alone (a loader the other ranks never build) cannot hang, and no collective is
issued. A single process keeps its own answer; so does a job whose store cannot be reached
(``shared`` False, so the caller can say so).
"""

from dataclasses import dataclass

from .. import dist as _dist

__all__ = ["first_answer", "Answer"]

PREFIX = "autopatch/data/answer/"


@dataclass(frozen=True)
class Answer:
    value: bytes
    own: bool      # this rank's answer was the one kept
    shared: bool   # the job's answer (False: this process answered alone)


def first_answer(question, mine):
    """The job's answer to ``question`` (a key), ``mine`` (bytes) offered as this rank's."""
    if _dist.world_size() == 1:
        return Answer(mine, True, True)
    from ..torch_internals import default_store
    store = default_store()
    if store is None:
        return Answer(mine, True, False)
    kept = store.compare_set(PREFIX + question, "", mine)
    return Answer(kept, kept == mine, True)
