"""The one ledger of everything autopatch has changed in torch, by target.

Each patch module (this package) opens a ``Section`` for its target when it installs, and records
every change there: an attribute wrapped or replaced keeps the exact original object (so
uninstalling restores identity), an attribute autopatch adds is deleted again, and torch hook
handles are removed in reverse order of installation. A section can be uninstalled on its own
(mode forward's read patches come and go with the mode); ``disable()`` uninstalls whatever is
still recorded, so nothing outlives it. ``LEDGER.installed()`` says what is in place now.

``standing`` holds what an imported autopatch module gives torch for as long as autopatch is in
use, not only while it is enabled (``model.with_bagua``): installed through the ledger whenever
autopatch is enabled.
"""

import contextlib
import sys
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


def when_imported(name, patch, still_wanted=lambda: True):
    """``patch(module)`` now if module ``name`` is imported, else right after its import (while
    ``still_wanted()``: an import hook cannot be unregistered). torch is never imported early."""
    if name in sys.modules:
        patch(sys.modules[name])
        return

    def hook(module):
        if still_wanted():
            patch(module)
    wrapt.register_post_import_hook(hook, name)


class Section:
    """The changes one patch module made for its target: installed together, removed together."""

    def __init__(self, ledger, target):
        self.target = target
        self._ledger = ledger
        self._patches = []   # (owner, name, original object from owner.__dict__)
        self._handles = []   # objects with .remove()
        self.removed = False

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
        """Torch hook handles (or anything with ``remove()``) to remove on uninstall."""
        self._handles.extend(handles)

    def uninstall(self):
        """Undo every change of this section, newest first (idempotent)."""
        while self._handles:
            self._handles.pop().remove()
        while self._patches:
            owner, name, original = self._patches.pop()
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self.removed = True
        self._ledger.closed(self)

    def changes(self):
        """(owner, name) of every attribute changed, and how many hooks are held."""
        return [(owner, name) for owner, name, _ in self._patches], len(self._handles)

    def __len__(self):
        return len(self._patches) + len(self._handles)


class Ledger:
    """Every section open in this process."""

    def __init__(self):
        self._lock = threading.Lock()
        self._sections = []

    def open(self, target):
        """A new section for ``target`` (a patch module's name), recorded until it is uninstalled."""
        section = Section(self, target)
        with self._lock:
            self._sections.append(section)
        return section

    def closed(self, section):
        with self._lock:
            if section in self._sections:
                self._sections.remove(section)

    def installed(self):
        """target -> {"attributes": [(owner, name), ...], "hooks": n} of what is in place now."""
        out = {}
        with self._lock:
            sections = list(self._sections)
        for section in sections:
            attributes, hooks = section.changes()
            entry = out.setdefault(section.target, {"attributes": [], "hooks": 0})
            entry["attributes"] += attributes
            entry["hooks"] += hooks
        return {t: e for t, e in out.items() if e["attributes"] or e["hooks"]}

    def uninstall(self):
        """Undo every section still open, newest first."""
        with self._lock:
            sections = list(self._sections)
        for section in reversed(sections):
            section.uninstall()


LEDGER = Ledger()


class Patch:
    """One target's patch (a module of this package): ``_open()`` a section as it installs,
    ``uninstall()`` removes it (idempotent, and harmless after ``disable()`` removed it)."""

    target = None
    _section = None

    @property
    def installed(self):
        return self._section is not None and not self._section.removed

    def _open(self):
        self._section = LEDGER.open(self.target)
        return self._section

    def uninstall(self):
        if self._section is not None:
            self._section.uninstall()
            self._section = None


class Standing:
    """Attributes an imported autopatch module gives torch, as the library it stands in for did on
    import (``autopatch.contrib.bagua`` gives every module ``with_bagua``): installed at once,
    removed by ``disable()`` with every other patch, and put back by the next ``enable()``, so a
    script that imported the module once finds them again whenever autopatch is on."""

    def __init__(self, ledger):
        self._ledger = ledger
        self._lock = threading.Lock()
        self._wanted = {}    # (owner, name) -> (target, value)
        self._on = {}        # (owner, name) -> the Section that installed it, while installed

    def add(self, target, owner, name, value):
        with self._lock:
            self._wanted[(owner, name)] = (target, value)
            self._put((owner, name))

    def install(self):
        with self._lock:
            for key in self._wanted:
                self._put(key)

    def _put(self, key):
        section = self._on.get(key)
        if section is None or section.removed:       # never put, or removed with the whole ledger
            target, value = self._wanted[key]
            section = self._ledger.open(target)
            section.add(*key, value)
            self._on[key] = section


standing = Standing(LEDGER)
