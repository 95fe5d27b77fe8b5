"""A list of callbacks whose every subscriber gets a handle that removes it (torch's hook style).

torch is never imported here: events are set up at ``enable()``, which may run before the program
imports torch.
"""

import itertools


class Subscription:
    """``remove()`` stops the calls (idempotent)."""

    def __init__(self, listeners, key):
        self._listeners, self._key = listeners, key

    def remove(self):
        self._listeners.unsubscribe(self._key)


class Listeners:
    """Called at every training step: the subscribers are kept as a tuple too, rebuilt when one
    comes or goes, so a call copies nothing (and a subscriber may remove itself while called)."""

    def __init__(self):
        self._callbacks = {}
        self._calls = ()
        self._keys = itertools.count()

    def subscribe(self, fn):
        key = next(self._keys)
        self._callbacks[key] = fn
        self._calls = tuple(self._callbacks.values())
        return Subscription(self, key)

    def unsubscribe(self, key):
        if self._callbacks.pop(key, None) is not None:
            self._calls = tuple(self._callbacks.values())

    def __call__(self, *args):
        """Call every subscriber, in the order they subscribed."""
        for fn in self._calls:
            fn(*args)

    def latest(self):
        """The newest subscriber, or None."""
        return next(reversed(self._callbacks.values()), None) if self._callbacks else None
