"""DistributedDataParallel: where a DDP model meets autopatch's takeover of its gradient sync.

Targets: ``DistributedDataParallel.__init__``, ``forward`` and the calls of
``torch_internals.DDP_HANDING_BACK`` (all wrapped). Internals: that table's method names.

- ``__init__``: every model built is offered to the takeover once DDP has built it (DDP checks
  shapes across ranks and broadcasts parameters and buffers from rank 0 as always);
- ``forward``: a model whose sync autopatch runs keeps DDP's reducer idle for this forward, as
  ``no_sync()`` does, and arms autopatch's allreduce instead (the takeover's ``forward``);
- the calls that mean DDP must reduce the model itself from now on (a comm hook registered, static
  graph set, an optimizer fused into backward, a ``Join`` context entered): the model is handed
  back first (``torch_internals.DDP_HANDING_BACK``).

Models built before the patch was installed are offered at their first forward since, or first
call that hands them back, whichever comes first: a model that never runs again is never touched,
and no scan of the process's objects takes a garbage model for a live one. ``uninstall`` restores
the class.
"""

import weakref

from ..torch_internals import DDP_HANDING_BACK
from .ledger import Patch

JOIN = "join_hook"      # a Join context: the model's ranks may step unevenly from now on


class DDPPatch(Patch):
    target = "ddp"

    def __init__(self, takeover):
        self.takeover = takeover
        self._building = weakref.WeakSet()      # models inside DDP's __init__: offered once built

    def install(self, distributed_module):
        ddp_class = distributed_module.DistributedDataParallel
        section = self._open()
        section.wrap(ddp_class, "__init__", self._after_init)
        section.wrap(ddp_class, "forward", self._forward)
        for name, reason in DDP_HANDING_BACK.items():
            section.wrap(ddp_class, name, self._handing_back(reason, uneven=name == JOIN))

    def _after_init(self, wrapped, instance, args, kwargs):
        self._building.add(instance)        # DDP's __init__ may call what hands a model back
        try:
            wrapped(*args, **kwargs)
        finally:
            self._building.discard(instance)
        self.takeover.adopt(instance)

    def _forward(self, wrapped, instance, args, kwargs):
        self._offered(instance)
        return self.takeover.forward(instance, wrapped, args, kwargs)

    def _handing_back(self, reason, uneven=False):
        def wrapper(wrapped, instance, args, kwargs):
            self._offered(instance)
            self.takeover.hand_back(instance, reason, uneven=uneven)
            return wrapped(*args, **kwargs)
        return wrapper

    def _offered(self, ddp):
        """A model built before the patch is offered to the takeover once, when first used."""
        if ddp not in self.takeover.models and ddp not in self._building:   # every model seen (the
            # known ones, every forward after the first, answer the first test)
            self.takeover.adopt(ddp)
