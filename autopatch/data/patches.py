"""The data side without code changes, installed into an autopatch ledger.

``DataPatches(cache=..., balance=...)`` takes plain settings (a policy's ``data`` section, or
``FUSEDOPT_DATA_CACHE`` / ``FUSEDOPT_DATA_BALANCE``), checks them at once, and imports nothing
heavy: ``install`` patches DataLoader when ``torch.utils.data`` is imported (at once if it is
already), through ``loader_hooks.LoaderHooks``. Uninstalling the ledger restores DataLoader and
hands loaders built meanwhile back their own dataset and sampler.
"""

import sys

import wrapt

from ..policy import cache_backend, complexity_spec

__all__ = ["DataPatches"]


class _Deactivation:
    """Held by the ledger, so that uninstalling it also deactivates the patches."""

    def __init__(self, patches):
        self.patches = patches

    def remove(self):
        self.patches.deactivate()


class DataPatches:
    def __init__(self, cache=None, name=None, capacity=None, path=None, balance=None):
        """``cache``: see ``cache_backend``; ``name``: prefix of every cache name; ``capacity``:
        bytes (the local store's size, or each Redis server's memory when autopatch starts
        them); ``path``: the local store's directory; ``balance``: ``len``, ``module:function``
        or a callable scoring a sample, or None. Bad values raise ValueError here."""
        self.backend = cache_backend(cache)
        complexity_spec(balance)
        if capacity is not None and int(capacity) <= 0:
            raise ValueError(f"data cache capacity {capacity!r} is not a positive number of bytes")
        self.name, self.capacity, self.path, self.balance = name, capacity, path, balance
        self.hooks = None      # the LoaderHooks of the current installation (kept for describe)
        self.active = False
        self._patched = False

    @property
    def served(self):
        """True once a DataLoader was built while the patches were installed."""
        return self.hooks is not None and self.hooks.loaders > 0

    @property
    def wanted(self):
        return self.backend is not None or self.balance is not None

    def install(self, ledger):
        """Patch DataLoader now, or when ``torch.utils.data`` is first imported."""
        if not self.wanted or self.active:
            return
        self.active = True
        ledger.hold(_Deactivation(self))
        if "torch.utils.data" in sys.modules:
            self._patch(ledger, sys.modules["torch.utils.data"])
        else:
            wrapt.register_post_import_hook(lambda module: self._patch(ledger, module), "torch.utils.data")

    def _patch(self, ledger, module):
        if not self.active or self._patched:   # post-import hooks cannot be unregistered
            return
        from .loader_hooks import LoaderHooks
        self._patched = True
        self.hooks = LoaderHooks(self)
        ledger.wrap(module.DataLoader, "__init__", self.hooks.on_init)
        if self.backend is not None:
            ledger.wrap(module.DataLoader, "__iter__", self.hooks.on_iter)

    def deactivate(self):
        self.active = False
        if self._patched:
            self.hooks.hand_back()
            self._patched = False

    def describe(self):
        """The report's ``data`` section: what was cached, how often it hit, what was left
        uncached and why; how evenly the balanced samplers spread the work."""
        if self.hooks is not None:
            return self.hooks.describe()
        return {"cache": {"enabled": self.backend is not None, "datasets": [], "uncached": []},
                "balance": {"enabled": self.balance is not None, "samplers": []}}
