"""The ledger of patches: everything autopatch installs is recorded here and undone on disable.

Attribute patches keep the exact original object (so ``disable()`` restores identity), and torch
hook handles are removed in reverse order of installation.
"""

import contextlib
import threading

import wrapt

_own = threading.local()


@contextlib.contextmanager
def own_objects():
    """Objects autopatch builds for itself inside this block (the fusability probe's copies of an
    optimizer) are not the program's: the patches let them be."""
    outer = getattr(_own, "active", False)
    _own.active = True
    try:
        yield
    finally:
        _own.active = outer


def building_own_objects():
    return getattr(_own, "active", False)


class Ledger:
    def __init__(self):
        self._patches = []   # (owner, name, original object from owner.__dict__)
        self._handles = []   # objects with .remove()

    def wrap(self, owner, name, wrapper):
        """Wrap ``owner.name`` with a wrapt function wrapper ``wrapper(wrapped, instance, args, kwargs)``."""
        original = vars(owner)[name]
        wrapt.wrap_function_wrapper(owner, name, wrapper)
        self._patches.append((owner, name, original))

    def replace(self, owner, name, function):
        """Set ``owner.name`` to a plain ``function`` that calls the original itself: cheaper per
        call than a wrapt wrapper, for patches on a hot path."""
        original = vars(owner)[name]
        setattr(owner, name, function)
        self._patches.append((owner, name, original))

    def hold(self, *handles):
        self._handles.extend(handles)

    def uninstall(self):
        while self._handles:
            self._handles.pop().remove()
        while self._patches:
            owner, name, original = self._patches.pop()
            setattr(owner, name, original)

    def __len__(self):
        return len(self._patches) + len(self._handles)
