"""Run a callback when this process exits, DataLoader workers included.

A multiprocessing child (a DataLoader worker) leaves through ``os._exit`` and never runs
``atexit``; it runs multiprocessing's own finalizers instead. Callbacks run in reverse order of
registration either way.
"""

import atexit
import multiprocessing
import multiprocessing.util

__all__ = ["at_exit"]


def at_exit(callback):
    if multiprocessing.parent_process() is None:
        atexit.register(callback)
    else:
        multiprocessing.util.Finalize(None, callback, exitpriority=10)
