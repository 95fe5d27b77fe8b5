"""The ledger of patches: everything autopatch installs is recorded here and undone on disable.

Attribute patches keep the exact original object (so ``disable()`` restores identity), an
attribute autopatch adds is deleted again, and torch hook handles are removed in reverse order of
installation. ``standing`` holds what an imported autopatch module gives torch for as long as
autopatch is in use, not only while it is enabled (``model.with_bagua``).
"""

import contextlib
import threading

import wrapt

_own = threading.local()
_ABSENT = object()     # the original of an attribute that autopatch added


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

    def add(self, owner, name, value):
        """Give ``owner`` the new attribute ``name``; uninstalling deletes it again."""
        if name in vars(owner):
            raise AttributeError(f"{owner.__name__}.{name} exists already: wrap or replace it instead")
        setattr(owner, name, value)
        self._patches.append((owner, name, _ABSENT))

    def hold(self, *handles):
        self._handles.extend(handles)

    def uninstall(self):
        while self._handles:
            self._handles.pop().remove()
        while self._patches:
            owner, name, original = self._patches.pop()
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)

    def __len__(self):
        return len(self._patches) + len(self._handles)


class Standing:
    """Attributes an imported autopatch module gives torch, as the library it stands in for did on
    import (``autopatch.contrib.bagua`` gives every module ``with_bagua``): installed at once,
    removed by ``disable()`` with every other patch, and put back by the next ``enable()``, so a
    script that imported the module once finds them again whenever autopatch is on."""

    def __init__(self):
        self._lock = threading.Lock()
        self._wanted = {}    # (owner, name) -> value
        self._on = {}        # (owner, name) -> the Ledger that installed it, while installed

    def add(self, owner, name, value):
        with self._lock:
            self._wanted[(owner, name)] = value
            self._put((owner, name))

    def install(self):
        with self._lock:
            for key in self._wanted:
                self._put(key)

    def uninstall(self):
        with self._lock:
            while self._on:
                self._on.popitem()[1].uninstall()

    def _put(self, key):
        if key not in self._on:
            ledger = Ledger()
            ledger.add(*key, self._wanted[key])
            self._on[key] = ledger


standing = Standing()
