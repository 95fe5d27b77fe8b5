"""Background averaging stops before torch.distributed does: at exit and in destroy_process_group.

A collective still under way when its process group is destroyed never completes (its wait ignores
the timeout), and a gloo worker still inside one when the interpreter exits aborts the process
("terminate called without an active exception"). So while any background averaging is alive,
``torch.distributed.destroy_process_group`` first stops it (the stop is agreed among the ranks,
each of which gets there by its own destroy, exit or ``abort()``), and an ``atexit`` handler does
the same for scripts that never destroy their group. The patch (patches/process_group.py) is
removed when the last averaging closes; ``atexit`` handlers run before the interpreter tears
threads and modules down, and torch registers none of its own.

A script that dies of an uncaught exception must not wait at exit for the others to finish (they
would train on alone, and it would be the job's failure that nobody sees): the interpreter has
printed the exception and kept it in ``sys.last_value`` by the time ``atexit`` runs, so then each
averaging ``leave()``s instead, which tells the others and waits for no one.
"""

import atexit
import sys
import threading
import weakref

import torch.distributed as dist

from ...patches.process_group import ProcessGroupPatch

_live = weakref.WeakSet()
_lock = threading.Lock()
_at_exit = {"registered": False}


def register(averaging):
    """``averaging`` has ``close()``, which stops it, and ``groups``, the process groups it uses;
    it is closed before any of them, or the whole of torch.distributed, is destroyed."""
    with _lock:
        if not _patch.installed:
            _patch.install()
        _live.add(averaging)
        if not _at_exit["registered"]:
            atexit.register(close_all)
            _at_exit["registered"] = True


def unregister(averaging):
    with _lock:
        _live.discard(averaging)
        if not _live:
            _patch.uninstall()


def close_all():
    """Stop every background averaging of this process (each ``close()`` is idempotent); at the
    exit of a script that died of an exception, leave it instead."""
    failed = getattr(sys, "last_value", None) is not None
    for averaging in list(_live):
        if failed:
            averaging.leave()
        else:
            averaging.close()


def _closing_first(group):
    """``group`` (None: every group) is about to be destroyed: the averaging using it stops first."""
    everything = group is None or group is dist.GroupMember.WORLD
    for averaging in list(_live):
        if everything or any(g is group for g in averaging.groups):
            averaging.close()


_patch = ProcessGroupPatch(_closing_first)
