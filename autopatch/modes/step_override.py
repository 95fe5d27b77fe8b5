"""One step of an optimizer run by another update than its own body (qadam past warm-up).

Built like a strategy: ``before_step`` runs the update (for a closure-based step, once the closure
has computed the gradients) and then gives every param group an empty params list with
``ParamSwap``, so the optimizer's own body, which still runs (its hooks, a closure, the step
count of a wrapper), updates nothing; ``after_step`` gives the lists back. The update works on the
optimizer's own per-parameter state, so checkpoints and a later return to the optimizer's own
step carry on from it.
"""

from ..fusion.param_swap import ParamSwap, fuse_when_grads_exist


class StepOverride:
    def __init__(self, opt, owner):
        """``owner``: what takes the step over; ``owner.step(opt)`` performs it."""
        self.opt = opt
        self.owner = owner
        self.lists = ParamSwap()

    def before_step(self, closure):
        """Returns the closure the optimizer should call instead, or None."""
        return fuse_when_grads_exist(closure, self._update)

    def _update(self):
        self.owner.step(self.opt)
        for group in self.opt.param_groups:
            self.lists.put(group, [])

    def after_step(self):
        self.lists.restore()
