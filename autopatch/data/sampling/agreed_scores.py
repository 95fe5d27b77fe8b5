"""Every rank balances with the same scores, or none does.

The load-balanced sampler deals indices to ranks from the samples' scores; ranks that score
differently deal differently, and then some samples are read by two ranks and others by none.
Scores can differ even under fixed seeds: a dataset may draw from a generator of its own seeded
per rank (random crops), or tokenise with a rank's state. So each rank offers its scores to the
job (``job_store.first_answer``: the first offered is every rank's; nothing waits), and every
rank deals from those. The n-th dataset of a class and length scored in a process meets the n-th
of every other rank; should ranks build different loaders, the scores they meet still have the
right length, and all that matters for dealing each sample once is that every rank holds the same
ones.
"""

import struct
from collections import Counter

from ...job_store import first_answer

__all__ = ["agreed_scores", "NoAgreement"]

_scored = Counter()   # (class, length) -> datasets scored so far in this process


class NoAgreement(RuntimeError):
    """The ranks cannot be shown to share one set of scores."""


def agreed_scores(dataset, mine):
    """(the job's scores for ``dataset``, a note on where they came from); NoAgreement when
    the ranks' scores cannot be made one."""
    if not mine:
        return mine, "an empty dataset"
    cls = type(dataset)
    kind = (f"{cls.__module__}.{cls.__qualname__}", len(mine))
    _scored[kind] += 1
    question = f"scores/{kind[0]}/{kind[1]}/{_scored[kind]}"
    answer = first_answer(question, struct.pack(f"<{len(mine)}d", *mine))
    if not answer.shared:
        raise NoAgreement("the job's store cannot be reached to agree on one set of scores, and ranks that "
                          "score differently would skip some samples and repeat others")
    if len(answer.value) != 8 * len(mine):
        raise NoAgreement(f"the scores the job agreed on are for {len(answer.value) // 8} samples, this rank's "
                          f"dataset has {len(mine)}")
    scores = list(struct.unpack(f"<{len(mine)}d", answer.value))
    if answer.own:
        return scores, "this rank's scores, which every rank uses"
    differ = sum(a != b for a, b in zip(scores, mine))
    return scores, ("the scores of the rank that scored first" +
                    (f" ({differ} of {len(mine)} differ from this rank's own)" if differ else ""))
