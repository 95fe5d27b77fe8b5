"""What a dataset is, in 16 bytes: its class, its length, a spread of its samples and the sizes
and times of the files it names (``dataset_files``); and which samples each epoch checks again.

Entries in the cache carry the signature of the dataset that wrote them, so a dataset whose
class, length, checked samples or named files changed reads none of an older version's entries. Samples are
loaded as a DataLoader worker would (``load_settings``: fixed seeds, one torch thread), so a
dataset has one signature on every rank and in every run.

A signature cannot load every sample, so a change elsewhere (between runs, or by the program
between epochs) is found by the recheck: each epoch, ``RECHECK_SAMPLES`` other samples are loaded
again and compared with their entries. The sets follow a fixed pseudo-random cycle through the
whole dataset (``recheck_indices``), the same on every rank, so every sample is checked once
every ``len / RECHECK_SAMPLES`` epochs; the named files are stat'ed again at every epoch.
"""

import hashlib
import math

from ..looking.load_settings import loaded_as
from ..store.sample_codec import encode
from .dataset_files import DatasetFiles

__all__ = ["spread_indices", "encoded_samples", "dataset_signature", "recheck_indices",
           "SIGNATURE_SEED", "SIGNATURE_SAMPLES", "RECHECK_SAMPLES"]

SIGNATURE_SEED = 0
SIGNATURE_SAMPLES = 16   # samples in the signature (benchmarks/RESULTS.md: what they cost)
RECHECK_SAMPLES = 8      # samples checked again at each epoch


def spread_indices(length, count=SIGNATURE_SAMPLES):
    """``count`` indices spread over the dataset, first and last included."""
    if length <= 0:
        return []
    return sorted({round(i * (length - 1) / max(1, count - 1)) for i in range(min(count, length))})


def encoded_samples(dataset, indices, seed=SIGNATURE_SEED, threads=1):
    """{index: encoded sample}, loaded under ``seed`` with ``threads`` torch threads."""
    with loaded_as(dataset, seed, threads) as source:
        return {i: encode(source[i]) for i in indices}


def dataset_signature(dataset, samples=None, files=None):
    """The signature of ``dataset`` from ``samples`` ({index: encoded sample loaded under
    SIGNATURE_SEED with one thread}) and ``files`` (its ``DatasetFiles``, whose ``changed`` then
    compares with what the signature saw); without them, both are found for it."""
    cls = type(dataset)
    length = len(dataset)
    if samples is None:
        samples = encoded_samples(dataset, spread_indices(length))
    if files is None:
        files = DatasetFiles.named_by(dataset)
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{cls.__module__}.{cls.__qualname__}\0{length}".encode())
    for i in sorted(samples):
        h.update(f"\0{i}:{len(samples[i])}\0".encode())
        h.update(samples[i])
    h.update(files.fingerprint())   # nothing when it names no file: such signatures stay as they were
    return h.digest()


def recheck_indices(length, signature, epoch, count=RECHECK_SAMPLES):
    """The indices to check again at ``epoch``: the next ``count`` of a full cycle through
    ``range(length)`` (``i -> (a * i + b) % length`` with ``a`` prime to ``length``), which the
    signature picks."""
    if length <= 0:
        return []
    seed = int.from_bytes(signature[:8] or b"\0", "little")
    a = 1 + seed % max(1, length - 1)
    while math.gcd(a, length) != 1:
        a += 1
    b = (seed >> 32) % length
    start = epoch * count
    return sorted({(a * k + b) % length for k in range(start, start + min(count, length))})
