"""Step the user's optimizer over a chosen subset of chunks, outside the user's own step() call.

Backward and forward fusion update a few chunks at a time. They call the class's step function
without torch's per-class hook wrapper, so neither autopatch's step hooks nor the user's fire once
per chunk; every other param group is emptied for the call, so nothing else moves.
"""

from .param_swap import ParamSwap


def step_chunks(opt, raw_step, items, hparams=None):
    """Run ``raw_step`` over ``items`` = [(group_index, chunk, chunk_state)]; a chunk may also be
    a parameter of the optimizer, stepped with its own state.

    ``hparams`` (group index -> dict) replaces group hyperparameters for the call: a deferred
    update must use the learning rate of the step() that recorded it, not a scheduler's newer one.
    """
    groups = opt.param_groups
    swap = ParamSwap()
    saved_hp = {}
    added = [chunk for _, chunk, _ in items if chunk not in opt.state]   # a param keeps its own
    try:
        for g in groups:
            swap.put(g, [])
        for gi, chunk, cs in items:
            groups[gi]["params"].append(chunk)
            opt.state[chunk] = cs
        for gi, hp in (hparams or {}).items():
            saved_hp[gi] = {k: groups[gi][k] for k in hp}
            groups[gi].update(hp)
        raw_step(opt)
    finally:
        swap.restore()
        for gi, hp in saved_hp.items():
            groups[gi].update(hp)
        for chunk in added:
            opt.state.pop(chunk, None)


def hyperparameters(group):
    """A snapshot of a param group's settings (everything but its params)."""
    return {k: v for k, v in group.items() if k != "params"}
