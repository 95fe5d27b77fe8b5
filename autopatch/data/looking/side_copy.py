"""Samples autopatch looks at itself (the probe, the signature, the per-epoch recheck, complexity
scores) are loaded from a shallow copy of the dataset, and leave every generator the dataset holds
as it was.

Many datasets set up state lazily on their first ``__getitem__`` (an HDF5 or lmdb file, a
database connection) precisely so that each DataLoader worker opens its own. Loaded from the
original in the main process, that state would be created there and inherited by every forked
worker, which libraries that are not fork-safe do not survive. On a shallow copy it stays on the
copy. A dataset that cannot be copied is used as it is.

A shallow copy still shares the dataset's own random generators (a ``torch.Generator``, a NumPy
``Generator`` or ``RandomState``, a ``random.Random``, held by the dataset or by its transforms),
and loading advances them: the run would then draw other numbers than unpatched. So each
generator reachable from the dataset (through attributes, and lists, tuples and dicts of at most
``MAX_ITEMS`` items, ``MAX_DEPTH`` levels down) has its state saved before and put back after.
"""

import contextlib
import copy
import random
import sys

import torch

__all__ = ["looking_at", "side_copy"]

MAX_DEPTH = 5
MAX_ITEMS = 256
_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.Tensor, type, type(sys))


def side_copy(dataset):
    try:
        return copy.copy(dataset)
    except Exception:
        return dataset


@contextlib.contextmanager
def looking_at(dataset):
    """A shallow copy of ``dataset`` to load from; the dataset's generators restored on exit."""
    saved = [(g, _state(g)) for g in _generators(dataset)]
    try:
        yield side_copy(dataset)
    finally:
        for g, state in saved:
            _restore(g, state)


def _kind(obj):
    if isinstance(obj, torch.Generator):
        return "torch"
    if isinstance(obj, random.Random):
        return "random"
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(obj, np.random.Generator):
            return "numpy"
        if isinstance(obj, np.random.RandomState):
            return "numpy legacy"
    return None


def _state(g):
    kind = _kind(g)
    if kind == "torch":
        return g.get_state()
    if kind == "random":
        try:
            return g.getstate()
        except NotImplementedError:   # SystemRandom: no state to advance
            return None
    if kind == "numpy":
        return g.bit_generator.state
    return g.get_state()


def _restore(g, state):
    if state is None:
        return
    kind = _kind(g)
    if kind == "torch":
        g.set_state(state)
    elif kind == "random":
        g.setstate(state)
    elif kind == "numpy":
        g.bit_generator.state = state
    else:
        g.set_state(state)


def _generators(root):
    found, seen, todo = [], set(), [(root, 0)]
    while todo:
        obj, depth = todo.pop()
        if id(obj) in seen or isinstance(obj, _LEAVES) or callable(obj) and not hasattr(obj, "__dict__"):
            continue
        seen.add(id(obj))
        if _kind(obj) is not None:
            found.append(obj)
            continue
        if depth >= MAX_DEPTH:
            continue
        if isinstance(obj, dict):
            children = list(obj.values()) if len(obj) <= MAX_ITEMS else []
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = list(obj) if len(obj) <= MAX_ITEMS else []
        else:
            try:
                children = list(vars(obj).values())
            except TypeError:
                children = []
        todo += [(c, depth + 1) for c in children]
    return found
