"""Whether the cache pays for a dataset: one decision for the whole job, from enough reads.

The cache is worth it when reading a sample back (store, integrity check and decoding) is at least
``READ_ADVANTAGE`` times faster than loading it. Reads are timed on the probe's samples, written
under scratch keys of the dataset's cache name (never served: the cache keeps only what the
user's loader loads) and read back ``READ_ROUNDS`` times, all at once as a batch is, then
deleted; the median counts. Ranks measure under different load, so a rank's decision is offered
to the job (``job_store.first_answer``) and the first one offered is every rank's; nothing waits.
"""

import os
import statistics
import time

from ... import dist as _dist
from ...job_store import first_answer

__all__ = ["cache_pays", "READ_ADVANTAGE", "READ_ROUNDS"]

READ_ADVANTAGE = 2.0   # cache only when a read is at least this many times faster than a load
READ_ROUNDS = 15       # reads of the probe's samples, each all at once; the median counts


def _read_seconds(loader, encoded):
    """Median seconds to read one of ``encoded``'s samples back, or (None, why not)."""
    # scratch keys of this process alone: ranks measuring at once on one store (a node's Redis)
    # must not read, or delete, each other's
    mine = f"probe-r{_dist.rank()}-p{os.getpid()}-"
    scratch = {f"{mine}{i}": data for i, data in encoded.items()}
    if not loader.put_encoded(scratch):
        return None, loader.last_error or "writing to the store failed"
    try:
        times = []
        for _ in range(READ_ROUNDS):
            start = time.perf_counter()
            found = loader.peek(list(scratch))
            times.append((time.perf_counter() - start) / len(scratch))
            if any(v is None for v in found):
                return None, loader.last_error or "a sample written was read back as missing"
        return statistics.median(times), None
    finally:
        loader.forget(list(scratch))


def cache_pays(loader, verdict):
    """(True, how it was decided) or (False, why not) for the dataset ``verdict`` describes."""
    read, error = _read_seconds(loader, verdict.samples)
    if read is None:
        return False, f"the cache does not keep samples: {error}"
    pays = verdict.load_seconds >= READ_ADVANTAGE * read
    figures = (f"loading a sample takes {1e6 * verdict.load_seconds:.0f} µs, reading it from the cache "
               f"{1e6 * read:.0f} µs (rank {_dist.rank()}, {READ_ROUNDS} reads of {len(verdict.samples)} samples)")
    mine = ("1" if pays else "0") + figures
    answer = first_answer(f"cache-pays/{loader.dataset_name}", mine.encode())
    decided = answer.value.decode()
    why = decided[1:] + ("" if answer.own else "; the job's decision, taken by the first rank to measure")
    if not answer.shared:
        why += "; this rank's own decision (the job's store cannot be reached to agree on one)"
    if decided[0] == "1":
        return True, why
    return False, f"{why}: the cache would not pay"
