"""The instances of a class alive in the process (autotune reads the batch size of the live
DataLoaders when its search starts; optimizers and DDP models built before ``enable()`` are adopted
when next used instead, which costs no scan).

One pass over the garbage collector's objects, testing each object's exact type against the set of
the class and its subclasses (a set lookup; ``issubclass`` or an MRO walk per object costs seconds
in a process that imported torch's compiler). Only when something is found is a full collection
run, so that garbage awaiting collection (a model from a finished run, kept in a reference cycle)
is not taken for a live object: an ``enable()`` in a fresh program pays one pass and no collection.
"""

import gc
import weakref


def subclasses(cls):
    """``cls`` and every class derived from it, as a set."""
    found, todo = {cls}, [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def live_instances(cls):
    """The instances of ``cls`` (or of a subclass) that a collection would not free."""
    classes = subclasses(cls)
    refs = [_weakly(o) for o in gc.get_objects() if type(o) in classes]
    if refs:
        gc.collect()
    return [o for o in (r() for r in refs) if o is not None]


def _weakly(obj):
    """A weak reference, or for a class whose ``__slots__`` allow none, a strong one (such an
    object is then taken as live)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj
