"""A list of callbacks whose every subscriber gets a handle that removes it (torch's hook style).

torch is never imported here: events are set up at ``enable()``, which may run before the program
imports torch.
"""

import itertools


class Subscription:
    """``remove()`` stops the calls (idempotent)."""

    def __init__(self, callbacks, key):
        self._callbacks, self._key = callbacks, key

    def remove(self):
        self._callbacks.pop(self._key, None)


class Listeners:
    def __init__(self):
        self._callbacks = {}
        self._keys = itertools.count()

    def subscribe(self, fn):
        key = next(self._keys)
        self._callbacks[key] = fn
        return Subscription(self._callbacks, key)

    def __call__(self, *args):
        """Call every subscriber, in the order they subscribed."""
        for fn in list(self._callbacks.values()):
            fn(*args)

    def latest(self):
        """The newest subscriber, or None."""
        return next(reversed(self._callbacks.values()), None) if self._callbacks else None
