"""Catching every step of one optimizer, once, however it is reached.

Interception uses the optimizer's own per-instance step hooks. ``Optimizer.step`` is wrapped once
per class by torch itself, and LR schedulers or wrappers such as accelerate's call through that
wrapper, so these hooks see every step however it is reached (closures included). A subclass whose
``step()`` calls ``super().step()`` runs torch's wrapper twice: only the outer call is the user's
step. ``state_dict()`` and ``load_state_dict()`` are hooked too, so nothing is pending or swapped
in while the state is read or replaced, and state held elsewhere (sharded across ranks) is packed.

From the pre-hook to the post-hook a step is in flight (``steps_in_flight.py``): enable() and
disable() never land inside it, so no step is ever half patched. A hook that torch calls after the
interception was removed (torch was about to call it as it was removed) does nothing, and so does
a post-hook whose step began before the interception existed.
"""

import time

from ..running_totals import TOTALS
from ..steps_in_flight import IN_FLIGHT
from ..torch_internals import nested_step_call, step_wrapper_code


class StepInterception:
    """Calls ``owner.step_begins(opt, closure)`` (which may return a closure to call instead),
    ``owner.step_ends(opt)``, ``owner.step_counted(opt)`` once the step's time is counted,
    ``owner.state_reading(opt)`` and ``owner.state_read(opt, state_dict)`` around ``state_dict()``
    (the latter may return a state dict to return instead: sharded state gathered),
    ``owner.state_io(opt)`` before the state is loaded, ``owner.state_loaded(opt)`` after, and
    ``owner.step_abandoned()`` when the last step raised before it ended."""

    def __init__(self, opt, owner):
        self.owner = owner
        self.steps = 0
        self.step_seconds = 0.0
        self._depth = 0               # nesting of step() calls on this optimizer
        self._t0 = None
        self._removed = False
        IN_FLIGHT.count_frames_of(step_wrapper_code())    # a step in flight is a region
        self._handles = [
            opt.register_step_pre_hook(self._pre_step),
            opt.register_step_post_hook(self._post_step),
            opt.register_state_dict_pre_hook(self._state_reading),
            opt.register_state_dict_post_hook(self._state_read),
            opt.register_load_state_dict_pre_hook(self._state_io),
            opt.register_load_state_dict_post_hook(self._state_loaded),
        ]

    def _pre_step(self, opt, args, kwargs):
        if self._depth and nested_step_call(opt):
            self._depth += 1          # super().step() inside the user's step(): not a new step
            return None
        if IN_FLIGHT.pending:
            IN_FLIGHT.entering()
        if self._removed:
            return None
        if self._depth:
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
        if not self._depth:
            return
        self._depth -= 1
        if self._depth > 0:
            return
        try:
            self.owner.step_ends(opt)
            if self._t0 is not None:
                seconds = time.perf_counter() - self._t0
                self.step_seconds += seconds
                TOTALS.optimizer += seconds
                self._t0 = None
            self.owner.step_counted(opt)
        finally:
            if IN_FLIGHT.pending:
                IN_FLIGHT.left()

    @IN_FLIGHT.region
    def _state_reading(self, opt):
        if not self._removed:
            self.owner.state_reading(opt)

    @IN_FLIGHT.region
    def _state_read(self, opt, state):
        if not self._removed:
            return self.owner.state_read(opt, state)
        return None

    @IN_FLIGHT.region
    def _state_io(self, opt, *args):
        if not self._removed:
            self.owner.state_io(opt)

    @IN_FLIGHT.region
    def _state_loaded(self, opt, *args):
        if not self._removed:
            self.owner.state_loaded(opt)

    def remove(self):
        self._removed = True
        for h in self._handles:
            h.remove()
        self._handles = []
