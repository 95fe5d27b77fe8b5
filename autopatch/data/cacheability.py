"""Whether the zero-code cache may serve a dataset without changing training.

A cache returns the first load of each sample forever after. That is only right when loading is
a function of the index, so four spread indices are each loaded under three different seeds of
every global generator (``rng_states``; each state restored afterwards) and compared byte for
byte; the first difference ends the probe. Left uncached, with the reason: iterable datasets
(no index), datasets without a length, samples that differ between loads (random augmentation
would be frozen), samples the cache cannot store exactly. Loads happen on a shallow copy
(``side_copy``), and their times are kept: whether the cache pays is decided against the store.
"""

import statistics
import time
from dataclasses import dataclass, field

from torch.utils.data import IterableDataset

from .rng_states import seeded
from .sample_codec import Unstorable, encode
from .side_copy import side_copy
from .signature import SIGNATURE_SEED, dataset_signature, spread_indices

__all__ = ["probe", "Verdict", "PROBE_SEEDS"]

PROBE_SEEDS = (SIGNATURE_SEED, 1, 2)


@dataclass
class Verdict:
    cacheable: bool
    reason: str = ""
    signature: bytes = b""
    samples: dict = field(default_factory=dict)   # index -> sample encoded, loaded under SIGNATURE_SEED
    load_seconds: float = 0.0                      # median time of one load


def probe(dataset):
    if isinstance(dataset, IterableDataset):
        return Verdict(False, "an iterable dataset has no index to cache its samples by")
    try:
        length = len(dataset)
    except (TypeError, NotImplementedError):
        return Verdict(False, "the dataset has no length")
    if length == 0:
        return Verdict(False, "the dataset is empty")
    source = side_copy(dataset)
    samples, times = {}, []
    for index in spread_indices(length):
        for seed in PROBE_SEEDS:
            try:
                with seeded(seed):
                    start = time.perf_counter()
                    sample = source[index]
                    times.append(time.perf_counter() - start)
                    data = encode(sample)
            except Unstorable as e:
                return Verdict(False, str(e))
            except Exception as e:
                return Verdict(False, f"loading sample {index} failed in the probe: {type(e).__name__}: {e}")
            if index not in samples:
                samples[index] = data
            elif data != samples[index]:
                return Verdict(False, f"sample {index} differs between loads under different random seeds: "
                                      "a cache would freeze its random augmentation")
    return Verdict(True, signature=dataset_signature(dataset, samples), samples=samples,
                   load_seconds=statistics.median(times))
