"""An optimizer's ``state`` while mode forward holds updates back: reading it applies them first.

Mode forward leaves each step's update pending until the module's next forward, and the
parameters' optimizer state (Adam's moments, the step count) moves with that update. A program
that reads ``optimizer.state`` in between (logging the step count, averaging the moments, a
look at the end of training) must see what it sees unpatched. So while a strategy defers,
``optimizer.state`` is a proxy of the optimizer's own state dict (the same object behind it, an
instance of its class to ``isinstance``) whose reads apply everything pending first; copies and
pickles of it are of the dict itself, and the dict is put back once the mode is left.
"""

import copy
import weakref

import wrapt


class PendingAwareState(wrapt.ObjectProxy):
    def __init__(self, state, apply):
        super().__init__(state)
        self._self_apply = weakref.WeakMethod(apply)

    def _self_fresh(self):
        apply = self._self_apply()
        if apply is not None:
            apply()

    def __getitem__(self, key):
        self._self_fresh()
        return self.__wrapped__[key]

    def get(self, key, default=None):
        self._self_fresh()
        return self.__wrapped__.get(key, default)

    def __contains__(self, key):
        self._self_fresh()
        return key in self.__wrapped__

    def __len__(self):
        self._self_fresh()
        return len(self.__wrapped__)

    def __iter__(self):
        self._self_fresh()
        return iter(self.__wrapped__)

    def keys(self):
        self._self_fresh()
        return self.__wrapped__.keys()

    def values(self):
        self._self_fresh()
        return self.__wrapped__.values()

    def items(self):
        self._self_fresh()
        return self.__wrapped__.items()

    def __copy__(self):
        self._self_fresh()
        return copy.copy(self.__wrapped__)

    def __deepcopy__(self, memo):
        self._self_fresh()
        return copy.deepcopy(self.__wrapped__, memo)

    def __reduce_ex__(self, protocol):
        self._self_fresh()
        return self.__wrapped__.__reduce_ex__(protocol)


def apply_on_read(opt, apply):
    """From now on, reading ``opt.state`` first calls ``apply`` (a bound method, held weakly)."""
    if not isinstance(opt.state, PendingAwareState):
        opt.state = PendingAwareState(opt.state, apply)


def plain_reads(opt):
    """``opt.state`` is the optimizer's own dict again."""
    if opt is not None and isinstance(opt.state, PendingAwareState):
        opt.state = opt.state.__wrapped__
