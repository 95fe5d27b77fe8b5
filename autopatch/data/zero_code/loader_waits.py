"""How long the training loop waits for its batches: the time inside every DataLoader iterator's
``__next__`` (patches/loader_iterator.py), in every enabled run (the report's breakdown reads it).

Which datasets were iterated is noted once per iterator (at its construction, once an epoch), for
the advice: a map-style dataset is one the cache can be asked to serve.
"""

from torch.utils.data import IterableDataset

from ...patches.loader_iterator import LoaderIteratorPatch
from ...running_totals import TOTALS

MAX_DATASETS = 8     # datasets described in the report; more are counted only


class LoaderWaits:
    def __init__(self):
        self.seconds = 0.0     # waited inside __next__ so far
        self.batches = 0
        self.datasets = {}     # id(dataset) -> its description, the first MAX_DATASETS
        self.more_datasets = 0

    def install(self):
        """Time ``__next__`` of every DataLoader iterator (call once ``torch.utils.data`` is imported)."""
        LoaderIteratorPatch(self).install()

    def waited(self, seconds):
        """One batch came after ``seconds``."""
        self.seconds += seconds
        self.batches += 1
        TOTALS.data += seconds

    def note(self, loader):
        dataset = loader.dataset
        if id(dataset) in self.datasets:
            return
        if len(self.datasets) >= MAX_DATASETS:
            self.more_datasets += 1
            return
        try:
            samples = len(dataset)
        except TypeError:
            samples = None
        # __class__, not type(): the data cache's proxy answers with the dataset's own class
        self.datasets[id(dataset)] = {"dataset": dataset.__class__.__qualname__,
                                      "map_style": not isinstance(dataset, IterableDataset) and samples is not None,
                                      "samples": samples, "workers": loader.num_workers}

    def describe(self):
        out = {"seconds": round(self.seconds, 6), "batches": self.batches, "datasets": list(self.datasets.values())}
        if self.more_datasets:
            out["more_datasets"] = self.more_datasets
        return out
