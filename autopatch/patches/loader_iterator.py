"""The DataLoader iterator: how long the training loop waits for each batch.

Targets: ``__init__`` and ``__next__`` of the iterator class every DataLoader iterator derives
from (``torch_internals.loader_iterator_class``, a private class), replaced by plain functions
(cheaper per batch than a wrapt wrapper: two ``perf_counter`` calls and two additions).
"""

import time

from ..torch_internals import loader_iterator_class
from .ledger import Patch


class LoaderIteratorPatch(Patch):
    target = "loader_iterator"

    def __init__(self, waits):
        """``waits``: has ``waited(seconds)`` (called on every batch) and ``note(loader)`` (called
        as each iterator is built, once an epoch)."""
        self.waits = waits

    def install(self):
        """Patch the iterator class (call once ``torch.utils.data`` is imported); nothing where
        this torch has no such class."""
        iterator = loader_iterator_class()
        if iterator is None or self.installed:
            return
        next_batch, init = vars(iterator)["__next__"], vars(iterator)["__init__"]
        waits = self.waits

        def __next__(it):
            t0 = time.perf_counter()
            try:
                return next_batch(it)
            finally:
                waits.waited(time.perf_counter() - t0)

        def __init__(it, loader, *args, **kwargs):
            init(it, loader, *args, **kwargs)
            waits.note(loader)

        section = self._open()
        section.replace(iterator, "__next__", __next__)
        section.replace(iterator, "__init__", __init__)
