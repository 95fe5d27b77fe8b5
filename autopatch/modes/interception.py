"""Catching every step of one optimizer, once, however it is reached.

Interception uses the optimizer's own per-instance step hooks. ``Optimizer.step`` is wrapped once
per class by torch itself, and LR schedulers or wrappers such as accelerate's call through that
wrapper, so these hooks see every step however it is reached (closures included). A subclass whose
``step()`` calls ``super().step()`` runs torch's wrapper twice: only the outer call is the user's
step. ``state_dict()`` and ``load_state_dict()`` are hooked too, so nothing is pending or swapped
in while the state is read or replaced, and state held elsewhere (sharded across ranks) is packed.
"""

import time

from ..torch_internals import nested_step_call


class StepInterception:
    """Calls ``owner.step_begins(opt, closure)`` (which may return a closure to call instead),
    ``owner.step_ends(opt)``, ``owner.step_counted(opt)`` once the step's time is counted,
    ``owner.state_io(opt)`` before the state is read or loaded, ``owner.state_packed(opt,
    state_dict)`` once it is packed (returns a state dict to return instead, or None),
    ``owner.state_loaded(opt)`` after a load, and ``owner.step_abandoned()`` when the last step
    raised before it ended."""

    def __init__(self, opt, owner):
        self.owner = owner
        self.steps = 0
        self.step_seconds = 0.0
        self._depth = 0               # nesting of step() calls on this optimizer
        self._t0 = None
        self._handles = [
            opt.register_step_pre_hook(self._pre_step),
            opt.register_step_post_hook(self._post_step),
            opt.register_state_dict_pre_hook(self._state_io),
            opt.register_state_dict_post_hook(owner.state_packed),
            opt.register_load_state_dict_pre_hook(self._state_io),
            opt.register_load_state_dict_post_hook(owner.state_loaded),
        ]

    def _pre_step(self, opt, args, kwargs):
        if self._depth:
            if nested_step_call(opt):
                self._depth += 1      # super().step() inside the user's step(): not a new step
                return None
            self.owner.step_abandoned()   # the last step() raised before its post-hook could run
        self._depth = 1
        self._t0 = time.perf_counter()
        self.steps += 1
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        replacement = self.owner.step_begins(opt, closure)
        if replacement is None:
            return None
        if len(args) > 1:
            return (args[0], replacement, *args[2:]), kwargs
        return args, dict(kwargs, closure=replacement)

    def _post_step(self, opt, args, kwargs):
        self._depth -= 1
        if self._depth > 0:
            return
        self.owner.step_ends(opt)
        if self._t0 is not None:
            self.step_seconds += time.perf_counter() - self._t0
            self._t0 = None
        self.owner.step_counted(opt)

    def _state_io(self, opt, *args):
        self.owner.state_io(opt)

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []
