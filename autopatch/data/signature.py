"""What a dataset is, in 16 bytes: its class, its length and a few of its samples.

Entries in the cache carry the signature of the dataset that wrote them, so a dataset whose
class, length or checked samples changed reads none of an older version's entries. Samples are
loaded under fixed seeds (every global generator restored afterwards), so a dataset that
augments at random still has one signature, the same on every rank and in every run.
"""

import hashlib

from .rng_states import seeded
from .sample_codec import encode
from .side_copy import side_copy

__all__ = ["spread_indices", "encoded_samples", "dataset_signature", "SIGNATURE_SEED"]

SIGNATURE_SEED = 0


def spread_indices(length, count=4):
    """``count`` indices spread over the dataset, first and last included."""
    if length <= 0:
        return []
    return sorted({round(i * (length - 1) / max(1, count - 1)) for i in range(min(count, length))})


def encoded_samples(dataset, indices, seed=SIGNATURE_SEED):
    """{index: encoded sample}, loaded under ``seed`` from a shallow copy (``side_copy``)."""
    source = side_copy(dataset)
    with seeded(seed):
        return {i: encode(source[i]) for i in indices}


def dataset_signature(dataset, samples=None):
    """The signature of ``dataset`` from ``samples`` ({index: encoded sample loaded under
    SIGNATURE_SEED}); without them, four spread samples are loaded for it."""
    cls = type(dataset)
    length = len(dataset)
    if samples is None:
        samples = encoded_samples(dataset, spread_indices(length))
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{cls.__module__}.{cls.__qualname__}\0{length}".encode())
    for i in sorted(samples):
        h.update(f"\0{i}:{len(samples[i])}\0".encode())
        h.update(samples[i])
    return h.digest()
