"""Whether the zero-code cache may serve a dataset without changing training.

A cache returns the first load of each sample forever after. That is only right when loading is
a function of the index, so four spread indices are each loaded under three different seeds of
every global generator and compared byte for byte; the first difference ends the probe. Left
uncached, with the reason: iterable datasets (no index), datasets without a length, samples that
differ between loads (random augmentation would be frozen), samples the cache cannot store
exactly or safely (``sample_codec``). The signature's samples are loaded on the way; every load
is made as a DataLoader worker makes it and leaves the dataset's own state alone
(``load_settings``), and nothing loaded here is ever stored: the cache only keeps what the
user's loader loaded. Load times are kept: whether the cache pays is decided against the store.
The files the dataset names are found once here (``dataset_files``), for the signature and for
each epoch's check.
"""

import statistics
import time
from dataclasses import dataclass, field

from torch.utils.data import IterableDataset

from ..looking.load_settings import torch_threads
from ..looking.rng_states import seeded
from ..looking.side_copy import looking_at
from ..store.sample_codec import Unstorable, encode
from .dataset_files import DatasetFiles
from .signature import SIGNATURE_SEED, dataset_signature, spread_indices

__all__ = ["probe", "Verdict", "PROBE_SEEDS", "DETERMINISM_SAMPLES"]

PROBE_SEEDS = (SIGNATURE_SEED, 1, 2)
DETERMINISM_SAMPLES = 4


@dataclass
class Verdict:
    cacheable: bool
    reason: str = ""
    signature: bytes = b""
    samples: dict = field(default_factory=dict)   # index -> sample encoded, loaded under SIGNATURE_SEED
    load_seconds: float = 0.0                      # median time of one load
    files: DatasetFiles = None                     # the files it names, as the signature saw them


def probe(dataset):
    if isinstance(dataset, IterableDataset):
        return Verdict(False, "an iterable dataset has no index to cache its samples by")
    try:
        length = len(dataset)
    except (TypeError, NotImplementedError):
        return Verdict(False, "the dataset has no length")
    if length == 0:
        return Verdict(False, "the dataset is empty")
    checked = set(spread_indices(length, DETERMINISM_SAMPLES))
    samples, times = {}, []
    with torch_threads(1), looking_at(dataset) as source:
        for index in spread_indices(length):
            for seed in PROBE_SEEDS if index in checked else PROBE_SEEDS[:1]:
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
    files = DatasetFiles.named_by(dataset)
    return Verdict(True, signature=dataset_signature(dataset, samples, files), samples=samples,
                   load_seconds=statistics.median(times), files=files)
