"""The data side without code changes, installed into an autopatch ledger.

``DataPatches(cache=..., balance=...)`` takes plain settings (a policy's ``data`` section, or
``FUSEDOPT_DATA_CACHE`` / ``FUSEDOPT_DATA_BALANCE``), checks their form at once, and imports
nothing heavy: ``install`` patches DataLoader when ``torch.utils.data`` is imported (at once if it
is already), through ``loader_hooks.LoaderHooks``. That may happen inside the program's
``import torch``, which must never fail for autopatch's sake: a failure there is a warning, the
data patches stay off, and the report says why (``FUSEDOPT_STRICT=1`` raises it instead).
Nothing a setting names is imported or called here (``complexity.py`` decides, when a sampler is
built). Uninstalling the ledger restores DataLoader and hands loaders built meanwhile back their
own dataset and sampler, and lets go of the cache's counters and connections.
"""

import sys
import warnings

import wrapt

from ... import env
from ...policy import cache_backend, complexity_spec

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
        self.off = None        # why the patches could not be installed, if they could not
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
        try:
            from .loader_hooks import LoaderHooks
            hooks = LoaderHooks(self)
            ledger.wrap(module.DataLoader, "__init__", hooks.on_init)
            if self.backend is not None:
                ledger.wrap(module.DataLoader, "__iter__", hooks.on_iter)
        except Exception as e:
            self.off = f"the data patches could not be installed: {type(e).__name__}: {e}"
            if env.flag(env.STRICT):
                raise
            warnings.warn(f"autopatch: {self.off}; DataLoader is left as it is", RuntimeWarning, stacklevel=2)
            return
        self.hooks, self._patched = hooks, True

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
        out = {"cache": {"enabled": self.backend is not None, "datasets": [], "uncached": []},
               "balance": {"enabled": self.balance is not None, "samplers": []}}
        if self.off:
            out["off"] = self.off
        return out
