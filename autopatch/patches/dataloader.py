"""DataLoader: the data side serves a loader's samples through the cache and balances its sampler.

Targets: ``torch.utils.data.DataLoader.__init__`` (every loader built) and, while a cache is
wanted, ``DataLoader.__iter__`` (each epoch). Internals: none.
"""

from .ledger import Patch


class _OnRemoval:
    """Held by the section, so that uninstalling it also calls ``fn`` (whatever removes it)."""

    def __init__(self, fn):
        self.fn = fn

    def remove(self):
        self.fn()


class DataLoaderPatch(Patch):
    target = "dataloader"

    def __init__(self, on_init, on_iter=None, on_removal=None):
        """``on_init`` and ``on_iter``: wrapt wrappers of the two methods (``on_iter`` None: not
        patched); ``on_removal()``: called when the patch is removed, before DataLoader is restored."""
        self._wrappers = {"__init__": on_init, "__iter__": on_iter}
        self._on_removal = on_removal

    def install(self, data_module):
        """Patch ``data_module`` (the imported ``torch.utils.data``), once."""
        if self.installed:
            return
        section = self._open()
        try:
            for name, wrapper in self._wrappers.items():
                if wrapper is not None:
                    section.wrap(data_module.DataLoader, name, wrapper)
        except Exception:
            section.uninstall()
            raise
        if self._on_removal is not None:
            section.hold(_OnRemoval(self._on_removal))
