"""What an enabled autopatch announces; each subscriber gets a handle that removes it.

- ``step_begins``: an optimizer's ``step()`` was called (``fn(optimizer_handle)``), before autopatch
  or the optimizer touches anything;
- ``step``: an optimizer finished a step (``fn(optimizer_handle)``), after its time was counted;
- ``switch``: an optimizer's mode changed (``fn(optimizer_handle)``);
- ``auto``: mode auto finished a measurement (``fn(optimizer_handle, figures)``).
"""

from ..listeners import Listeners

NAMES = ("step_begins", "step", "switch", "auto")


class Events:
    def __init__(self):
        self._listeners = {name: Listeners() for name in NAMES}

    def subscribe(self, name, fn):
        if name not in self._listeners:
            raise ValueError(f"unknown event {name!r}; expected one of {', '.join(NAMES)}")
        return self._listeners[name].subscribe(fn)

    def emit(self, name, *args):
        self._listeners[name](*args)

    def emitter(self, name):
        """``emit`` of one event as a callable of its own, for those who announce it at every step."""
        return self._listeners[name]
