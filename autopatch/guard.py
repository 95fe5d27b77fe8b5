"""A failure of autopatch inside one optimizer's step falls back to that optimizer's unpatched step.

The controller runs everything autopatch does in a step under ``fallback(ctrl, opt, where)``:
deciding the mode (probe, planning), swapping chunks in before the optimizer's own step (and
after a closure), swapping back after it, and the flushes before ``state_dict()`` and after
``load_state_dict()``. An exception there does not reach the user's program: the optimizer's
param groups are put back as they were before the step, the mode becomes ``off`` for good, a
warning goes to stderr and the report's reason says where and what failed. The step itself then
runs unpatched. Exceptions raised by the user's own code (the closure, the optimizer's ``step()``
body) are the user's and pass through untouched. ``FUSEDOPT_STRICT=1`` raises autopatch's own
failure instead, for whoever wants to see it.
"""

import warnings
import weakref

from . import env

_fallen = weakref.WeakSet()                  # controllers that fell back: never fused again
_before = weakref.WeakKeyDictionary()        # controller -> its groups' params lists before the step
_USERS = "__autopatch_raised_by_user_code__"


def fell_back(ctrl):
    return ctrl in _fallen


class fallback:
    """``with fallback(ctrl, opt, "planning"):`` turns autopatch's failure into a fallback."""

    def __init__(self, ctrl, opt, where):
        self.ctrl, self.opt, self.where = ctrl, opt, where

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if not isinstance(error, Exception) or getattr(error, _USERS, False):
            return False
        if env.flag(env.STRICT):
            return False
        fall_back(self.ctrl, self.opt, self.where, error)
        return True


def before_step(ctrl, opt, closure):
    """The strategy's ``before_step(closure)`` under the guard; returns the closure the optimizer
    should call instead, or None. The replacement runs the user's closure as the user's code and
    the swap-in that follows it under the guard."""
    _before[ctrl] = [g["params"] for g in opt.param_groups]
    replacement = None
    marked = None if closure is None else _as_user_code(closure)
    with fallback(ctrl, opt, "preparing the fused step"):
        replacement = ctrl.strategy.before_step(marked)
    if replacement is None:
        return None

    def guarded():
        loss = None
        with fallback(ctrl, opt, "preparing the fused step"):
            loss = replacement()
        if fell_back(ctrl) and loss is None:
            loss = marked()     # it failed before the user's closure ran: run it now, once
        return loss
    return guarded


def after_step(ctrl, opt):
    """The strategy's ``after_step()`` under the guard."""
    with fallback(ctrl, opt, "restoring the optimizer after the fused step"):
        ctrl.strategy.after_step()
    _before.pop(ctrl, None)


def _as_user_code(closure):
    ran = []

    def users_closure():
        if ran:
            return ran[0]
        try:
            loss = closure()
        except BaseException as e:
            setattr(e, _USERS, True)
            raise
        ran.append(loss)
        return loss
    return users_closure


def fall_back(ctrl, opt, where, error):
    """Put ``opt`` back as unpatched and keep it so, saying why."""
    what = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")[:300]
    reason = f"fell back to the unpatched step: {where} failed ({what})"
    strategy, ctrl.strategy = ctrl.strategy, None
    if ctrl.observation is not None:
        ctrl.observation.close()
        ctrl.observation = None
    ctrl.runtime.disable_forward_fusion(ctrl)
    fusion = {}
    if strategy is not None:
        try:
            strategy.deactivate()
        except Exception as e:
            reason += f"; putting the optimizer back also failed ({type(e).__name__})"
        try:
            fusion = strategy.describe()
        except Exception:
            fusion = {}
    for group, params in zip(opt.param_groups, _before.pop(ctrl, [])):
        group["params"] = params          # whatever the strategy managed to restore
    users = {id(p) for g in opt.param_groups for p in g["params"]}
    for key in [k for k in opt.state if id(k) not in users]:
        del opt.state[key]    # chunks' state left by a half-done swap (state_dict() could not pack it)
    ctrl.final_fusion = dict(fusion, fallback={"where": where, "error": what})
    ctrl.decided = True
    ctrl.mode, ctrl.reason = "off", reason
    _fallen.add(ctrl)
    warnings.warn(f"autopatch: {ctrl.qualname}: {reason}; FUSEDOPT_STRICT=1 raises it instead",
                  RuntimeWarning, stacklevel=2)
