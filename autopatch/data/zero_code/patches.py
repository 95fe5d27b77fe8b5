"""The data side without code changes: what the DataLoader patch (patches/dataloader.py) does.

``DataPatches(cache=..., balance=...)`` takes plain settings (a policy's ``data`` section, or
``FUSEDOPT_DATA_CACHE`` / ``FUSEDOPT_DATA_BALANCE``), checks their form at once, and imports
nothing heavy: ``install`` patches DataLoader when ``torch.utils.data`` is imported (at once if it
is already), with ``loader_hooks.LoaderHooks`` as the patch's wrappers. That may happen inside the program's
``import torch``, which must never fail for autopatch's sake: a failure there is a warning, the
data patches stay off, and the report says why (``FUSEDOPT_STRICT=1`` raises it instead).
Nothing a setting names is imported or called here (``complexity.py`` decides, when a sampler is
built). ``uninstall`` (or ``disable()``, which removes every patch) restores DataLoader and hands
loaders built meanwhile back their own dataset and sampler, and lets go of the cache's counters
and connections.
"""

import warnings

from ... import env
from ...patches.dataloader import DataLoaderPatch
from ...patches.ledger import when_imported
from ...policy import cache_backend, complexity_spec

__all__ = ["DataPatches"]


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
        self._patch = None     # the DataLoaderPatch in place

    @property
    def served(self):
        """True once a DataLoader was built while the patches were installed."""
        return self.hooks is not None and self.hooks.loaders > 0

    @property
    def wanted(self):
        return self.backend is not None or self.balance is not None

    def install(self):
        """Patch DataLoader now, or when ``torch.utils.data`` is first imported."""
        if not self.wanted or self.active:
            return
        self.active = True
        when_imported("torch.utils.data", self._patch_loader, still_wanted=lambda: self.active)

    def _patch_loader(self, module):
        if not self.active or self._patch is not None:
            return
        try:
            from .loader_hooks import LoaderHooks
            hooks = LoaderHooks(self)
            patch = DataLoaderPatch(hooks.on_init, hooks.on_iter if self.backend is not None else None,
                                    on_removal=self._removed)
            patch.install(module)
        except Exception as e:
            self.off = f"the data patches could not be installed: {type(e).__name__}: {e}"
            if env.flag(env.STRICT):
                raise
            warnings.warn(f"autopatch: {self.off}; DataLoader is left as it is", RuntimeWarning, stacklevel=2)
            return
        self.hooks, self._patch = hooks, patch

    def uninstall(self):
        """Restore DataLoader; loaders built meanwhile get their own dataset and sampler back."""
        self.active = False
        if self._patch is not None:
            self._patch.uninstall()

    def _removed(self):
        """The patch is being removed (``uninstall``, or ``disable()`` removing every patch)."""
        self.active = False
        self._patch = None
        self.hooks.hand_back()

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
