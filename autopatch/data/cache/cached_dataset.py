"""Bagua's ``CachedDataset``: a dataset whose samples are kept in a store after the first load.

Same arguments and key layout as Bagua (``"{dataset_name}_{index}"``, writes buffered and sent
with ``mset``, misses and store errors computed). Two differences: entries carry the dataset's
signature (``signature.py``), so a changed dataset is never served an older version's samples,
even from a cache that outlived the run; and ``__getitems__`` reads a whole batch with one
``mget``, which DataLoader uses when it exists.

Like Bagua's, it caches what ``dataset[index]`` returns, transforms included: a dataset that
augments at random gets its first augmentation frozen. The zero-code path (``patches.py``)
checks for that and leaves such datasets uncached.
"""

import copy

from torch.utils.data import Dataset

from ..probe.signature import dataset_signature
from .cache_loader import CacheLoader

__all__ = ["CachedDataset"]


class CachedDataset(Dataset):
    def __init__(self, dataset, backend="local", dataset_name="", writer_buffer_size=20,
                 signature=None, **kwargs):
        """``kwargs`` go to the store (see ``CacheLoader``). ``signature``: the dataset's, when the
        caller has it already (``signature.dataset_signature``); computed otherwise, which loads
        ``signature.SIGNATURE_SAMPLES`` samples."""
        self.dataset = dataset
        self.signature = signature if signature is not None else dataset_signature(dataset)
        self.cache_loader = CacheLoader(backend, dataset_name, writer_buffer_size,
                                        stamp=self.signature, **kwargs)

    def _load(self, index):
        return self.dataset[index]

    def _load_many(self, indices):
        if callable(getattr(self.dataset, "__getitems__", None)):
            return self.dataset.__getitems__(indices)
        return [self.dataset[i] for i in indices]

    def __getitem__(self, index):
        return self.cache_loader.get(index, self._load)

    def __getitems__(self, indices):
        return self.cache_loader.get_many(list(indices), self._load_many)

    def __len__(self):
        return len(self.dataset)

    def __copy__(self):
        """The same cache over a shallow copy of the dataset (see ``side_copy``)."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__, dataset=copy.copy(self.dataset))
        return twin

    def describe(self):
        return self.cache_loader.describe()
