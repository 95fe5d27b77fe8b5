"""The report's sections beyond the optimizers, each written by the room that knows it.

The runtime adds ``allreduce`` (the DDP takeover, or why there is none) and ``autotune`` (off, or
why); the autotuner adds its own ``autotune`` while it runs, which shadows the runtime's until its
handle is removed.
"""

from ..listeners import Listeners


class ReportSections:
    def __init__(self):
        self._by_name = {}        # name -> Listeners of describe functions, the newest wins

    def add(self, name, describe):
        """``describe()`` returns the section's JSON-serialisable dict; returns a handle."""
        return self._by_name.setdefault(name, Listeners()).subscribe(describe)

    def describe(self):
        out = {}
        for name, layers in self._by_name.items():
            describe = layers.latest()
            if describe is not None:
                out[name] = describe()
        return out
