"""torch.distributed as autopatch asks it: world size, rank, and who decides for everyone.

torch.distributed is looked up, never imported: a program that has not imported it runs in one
process, and ``import autopatch`` stays free of torch.
"""

import os
import sys


def _initialised():
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist
    except Exception:     # a half-torn-down process group
        pass
    return None


def _group():
    """torch.distributed when this process is one of several, else None."""
    dist = _initialised()
    return dist if dist is not None and dist.get_world_size() > 1 else None


def initialised():
    """True when torch.distributed has a process group set up in this process."""
    return _initialised() is not None


def world_size():
    dist = _group()
    return dist.get_world_size() if dist else 1


def rank():
    """This process's rank: torch.distributed when initialised, else torchrun's RANK, else 0."""
    dist = _initialised()
    if dist is not None:
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def default_group_id():
    """An id of the default process group while one is set up (a new one after re-initialising)."""
    dist = _initialised()
    return None if dist is None else id(dist.group.WORLD)


def is_decider():
    """Rank 0 decides for everyone (autotune, mode auto); a single process decides for itself."""
    dist = _group()
    return dist is None or dist.get_rank() == 0


def first_rank(group=None):
    """The global rank of ``group``'s first rank (None: the world's, 0)."""
    dist = _initialised()
    return 0 if dist is None or group is None else dist.get_process_group_ranks(group)[0]
