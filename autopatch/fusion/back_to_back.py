"""Runs of parameters that already lie back to back in one storage, as a flat buffer would.

A buffer the user built (or Bagua-style code before autopatch) may already hold a group's
parameters contiguously; such a run can be stepped as a flat buffer where it lies, without moving
anything. Parameters whose memory overlaps another's never count: moving or stepping one of them
would split an alias.
"""

from ..storage_extent import storage_extent
from .flattenable import foreign_memory, unfusable_param
from .flat_run import state_signature, unflattenable_state


def runs_in_place(opt):
    """Runs of two or more parameters of one group already back to back in one storage, as
    [(storage ptr, group index, [(param, state signature)])], and {id(param): why not}."""
    groups = opt.param_groups
    why_not, shared = _overlapping(groups)
    runs = []
    for gi, group in enumerate(groups):
        candidates = []
        for p in group["params"]:
            why = why_not.get(id(p)) or unfusable_param(p)
            sig = None if why else state_signature(p, opt.state.get(p, {}))
            if why is None and sig is None:
                why = unflattenable_state(p, opt.state.get(p, {}))
            if why:
                why_not[id(p)] = why
            else:
                candidates.append((p, sig))
        runs += [(ptr, gi, run) for ptr, run in _back_to_back(candidates)
                 if len(run) > 1 and ptr not in shared]
    return runs, why_not


def _overlapping(groups):
    """Parameters whose memory overlaps another's, as {id(param): reason}, and their storages."""
    spans = []   # (storage ptr, first byte, bytes spanned, param)
    for g in groups:
        for p in g["params"]:
            if p.numel() and not foreign_memory(p):   # never read a storage that is not there
                elems = storage_extent(p.shape, p.stride())
                size = p.element_size()
                spans.append((p.untyped_storage().data_ptr(), p.storage_offset() * size, elems * size, p))
    spans.sort(key=lambda s: s[:3])
    out, storages, last = {}, set(), None   # last: (ptr, end, param) of the span reaching furthest so far
    for ptr, start, extent, p in spans:
        if last is not None and last[0] == ptr and start < last[1]:
            out[id(p)] = out[id(last[2])] = "overlaps another parameter's memory"
            storages.add(ptr)
        if last is None or last[0] != ptr or start + extent > last[1]:
            last = (ptr, start + extent, p)
    return out, storages


def _back_to_back(candidates):
    """Split ``[(param, sig)]`` into maximal runs, in storage order, of dense parameters (in any
    memory order) that follow each other in one storage with equal dtype and state signature."""
    runs = []   # [ptr, end offset, dtype, sig, [(param, sig)]]
    key = lambda c: (c[0].untyped_storage().data_ptr(), c[0].storage_offset())
    for p, sig in sorted(candidates, key=key):
        ptr, start = key((p, sig))
        r = runs[-1] if runs else None
        if r is not None and r[0] == ptr and r[1] == start and r[2] == p.dtype and r[3] == sig:
            r[1] += p.numel()
            r[4].append((p, sig))
        else:
            runs.append([ptr, start + p.numel(), p.dtype, sig, [(p, sig)]])
    return [(r[0], r[4]) for r in runs]
