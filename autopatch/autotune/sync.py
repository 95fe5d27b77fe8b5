"""Distributed agreement: rank 0 decides, every rank receives the same decision at the same step.

Decisions are taken at iterations every rank knows in advance, so the broadcast is one more
collective in the same order on every rank.
"""

import sys


def _group():
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def world_size():
    dist = _group()
    return dist.get_world_size() if dist else 1


def is_decider():
    dist = _group()
    return dist is None or dist.get_rank() == 0


def agree(decision):
    """Rank 0's ``decision`` (any picklable object) on every rank; other ranks pass None."""
    dist = _group()
    if dist is None:
        return decision
    box = [decision]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(value):
    """Every rank's ``value`` (any picklable object), in rank order, on every rank."""
    dist = _group()
    if dist is None:
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
