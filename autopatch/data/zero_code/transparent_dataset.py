"""The user's dataset, served through the cache, looking like itself.

DataLoader keeps the dataset it was given as ``loader.dataset``, which training code reads
(``loader.dataset.classes``, ``len(loader.dataset)``, ``isinstance``). A wrapt ObjectProxy keeps
all of that the dataset's own; only indexing goes through the ``CachedDataset``. The proxy adds
no public name that could hide one of the dataset's: it is handled through this module's
functions. ``bypass`` turns the cache off for the dataset (a sample changed during the run,
autopatch was disabled): samples then come from the dataset itself.
"""

import copy

import wrapt

__all__ = ["TransparentCachedDataset", "bypass"]


class TransparentCachedDataset(wrapt.ObjectProxy):
    def __init__(self, dataset, cached, bypassed=None):
        super().__init__(dataset)
        self._self_cached = cached
        self._self_bypassed = bypassed

    def __getitem__(self, index):
        if self._self_bypassed:
            return self.__wrapped__[index]
        return self._self_cached[index]

    def __getitems__(self, indices):
        if self._self_bypassed:
            own = getattr(self.__wrapped__, "__getitems__", None)
            return own(indices) if callable(own) else [self.__wrapped__[i] for i in indices]
        return self._self_cached.__getitems__(indices)

    def __reduce_ex__(self, protocol):   # DataLoader workers started by spawn or forkserver
        return TransparentCachedDataset, (self.__wrapped__, self._self_cached, self._self_bypassed)

    def __copy__(self):
        cached = copy.copy(self._self_cached)
        return TransparentCachedDataset(cached.dataset, cached, self._self_bypassed)


def bypass(proxy, reason):
    proxy._self_bypassed = reason
