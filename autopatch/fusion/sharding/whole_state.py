"""A sharded flat run's optimizer state, whole again: what every parameter's state is on the rank
that holds it, gathered from all ranks (a collective; comm/shard_exchange.py moves the bytes).

A full-size state tensor (Adam's moments) comes back as one buffer of the run's length per key,
each rank's share broadcast into it, and every parameter's state a view of it with the parameter's
shape and strides, as an unsharded run holds it. A 0-dim tensor (Adam's ``step``) or a Python
value of a parameter is taken from the rank whose share holds the parameter's first element.
"""

import torch


def _first_elements(run):
    """``{parameter index: chunk index}`` for the parameters whose first element this rank holds."""
    out, ci = {}, 0
    for i, o in enumerate(run.offsets):
        if run.lo <= o < run.hi:
            while run.chunk_bounds[ci][1] <= o:
                ci += 1
            out[i] = ci
    return out


def _local_entries(run):
    """What this rank knows of the parameters whose first element it holds: per parameter, key ->
    ("full", dtype), ("scalar", value) or ("python", value), in the order the optimizer made them."""
    entries = {}
    for i, ci in _first_elements(run).items():
        entry = {}
        for key, v in run.chunk_states[ci].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                entry[key] = ("full", v.dtype)
            elif isinstance(v, torch.Tensor):
                entry[key] = ("scalar", run.scalar_state[key][i].clone())
            else:
                entry[key] = ("python", v)
        entries[i] = entry
    return entries


def gather_state(run, exchange):
    """Every parameter's optimizer state of ``run`` (sharded), whole, in parameter order; ``{}``
    for a parameter without state. Every rank of ``exchange``'s group must call it alike."""
    merged = {}
    for entries in exchange.gather_objects(_local_entries(run)):
        merged.update(entries)
    whole = _whole_buffers(run, merged)
    exchange.broadcast_shares([(buf, run.cuts) for buf in whole.values()])
    return _per_parameter(run, merged, whole)


def local_part(run):
    """What this rank's broadcasts give the others of ``run``: its entries, and its share of each
    full-size state tensor (a copy)."""
    return _local_entries(run), {key: t.clone() for key, t in run.flat_state.items()}


def served_state(run, parts):
    """``gather_state``'s result, from the other ranks' ``local_part`` of ``run`` (``parts``:
    their group rank -> part) and this rank's own; no collective."""
    merged = _local_entries(run)
    for part in parts.values():
        merged.update(part[0])
    whole = _whole_buffers(run, merged)
    for r, (_, shares) in parts.items():
        for key, buf in whole.items():
            if key in shares:
                buf[run.cuts[r]:run.cuts[r + 1]].copy_(shares[key])
    return _per_parameter(run, merged, whole)


def _whole_buffers(run, merged):
    """key -> a buffer of the run's length for each full-size state tensor, this rank's share in."""
    dtypes = {}
    for entry in merged.values():
        dtypes.update((key, x) for key, (kind, x) in entry.items() if kind == "full")
    whole = {}
    for key, dtype in dtypes.items():
        buf = whole[key] = torch.empty(run.numel, dtype=dtype, device=run.flat.device)
        if key in run.flat_state:
            buf[run.lo:run.hi].copy_(run.flat_state[key])
    return whole


def _per_parameter(run, merged, whole):
    return [{key: run.param_view(whole[key], i) if kind == "full" else x
             for key, (kind, x) in merged.get(i, {}).items()} for i in range(len(run.params))]
