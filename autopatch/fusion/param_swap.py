"""Putting other tensors in place of an optimizer's param lists for one call, and back.

Every fused step works by giving the optimizer's own ``step()`` a different ``params`` list for
some groups (chunks of flat buffers, local shards, a few chunks at a time) and restoring the
user's lists afterwards, so that outside ``step()`` the optimizer holds exactly what it holds
unpatched. This is the one place that saves and restores those lists; restoring runs in reverse
order, so nested swaps unwind correctly. The first ``put`` on a group tells ``stand_ins`` the
user's list, for code that must see it during the step, until a ``restore`` puts it back (the
swap's own, or an outer one's after a failure left the inner one undone).
"""

from ..stand_ins import hold_user_params, release_user_params


class ParamSwap:
    def __init__(self):
        self._saved = []      # (group, the params list it held before)

    def put(self, group, params):
        """Give ``group`` the list ``params`` until ``restore()``."""
        self._saved.append((group, group["params"]))
        hold_user_params(group)
        group["params"] = params

    def remember(self, groups):
        """Keep every group's current list, to put back at ``restore()`` whatever happens to it."""
        self._saved.extend((g, g["params"]) for g in groups)

    def show_saved(self):
        """Put the saved lists back for a while (the state is read inside the step: a checkpoint
        from a step hook or a signal handler); returns the ParamSwap whose ``restore()`` puts back
        the lists in place now."""
        shown = ParamSwap()
        for group, params in self._saved:
            if group["params"] is not params:
                shown.put(group, params)
        return shown

    def restore(self):
        saved, self._saved = self._saved, []
        for group, params in reversed(saved):
            group["params"] = params
            release_user_params(group, params)

    def __bool__(self):
        return bool(self._saved)


def then(closure, after):
    """A closure that runs the user's ``closure`` (which computes the gradients), then ``after()``,
    and returns the closure's loss: fusion can only begin once the gradients exist."""
    def closure_then():
        loss = closure()
        after()
        return loss
    return closure_then


def fuse_when_grads_exist(closure, fuse):
    """Run ``fuse()`` now, or, for a closure-based step, right after the closure computes the
    gradients. Returns the closure the optimizer should call instead, or None."""
    if closure is None:
        fuse()
        return None
    return then(closure, fuse)
