"""The user's tensors behind the ones a fused step hands an optimizer in their place.

A fused step gives the optimizer's own ``step()`` other tensors than the user's for the length of
the call (flat chunks, local shards: ``fusion/param_swap.py``). Code that reads the param groups
inside such a step asks here what the user's optimizer holds: ``stands_for(tensor)``, the
parameters whose memory a stepped tensor updates, and ``user_params(group)``, the list the group
holds outside the step, in the user's order. A communication algorithm checks with them which
parameters an optimizer updates; QAdam lays out the moments it averages in the unpatched order.
The fusion side writes (``cover``, ``hold_user_params``, ``release_user_params``); all others read.
"""

from torch.utils.weak import WeakIdKeyDictionary

_covered = WeakIdKeyDictionary()   # a live chunk -> the parameters it spans
_outside = {}                      # id(group) -> (group, the params list it holds outside the step)


def cover(tensor, params):
    """``tensor`` (a chunk) updates the memory of ``params``."""
    _covered[tensor] = tuple(params)


def stands_for(tensor):
    """The parameters whose memory ``tensor`` updates: those a chunk spans, else ``(tensor,)``."""
    return _covered.get(tensor, (tensor,))


def hold_user_params(group):
    """``group``'s list is about to be replaced for a step: keep the one it holds, unless a list
    is kept for it already (an outer swap's, the user's)."""
    if id(group) not in _outside:
        _outside[id(group)] = (group, group["params"])


def release_user_params(group, params):
    """``group`` holds ``params`` again: when that is the kept list, the swap is over."""
    kept = _outside.get(id(group))
    if kept is not None and kept[1] is params:
        del _outside[id(group)]


def user_params(group):
    """The params list ``group`` holds outside fused steps, even while one runs."""
    kept = _outside.get(id(group))
    return kept[1] if kept is not None and kept[0] is group else group["params"]
