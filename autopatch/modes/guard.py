"""A failure of autopatch inside one optimizer's step falls back to that optimizer's unpatched step.

Everything autopatch does in a step runs under ``fallback(active, opt, where)``: deciding the mode
(probe, planning), swapping chunks in before the optimizer's own step (and after a closure),
swapping back after it, and the flushes before ``state_dict()`` and after ``load_state_dict()``.
An exception there does not reach the user's program: the guard asks the active mode to fall
back (modes/active.py puts the optimizer back as unpatched, for good, and says why), and the step
itself then runs unpatched. Exceptions raised by the user's own code (the closure, the optimizer's
``step()`` body) are the user's and pass through untouched. ``FUSEDOPT_STRICT=1`` raises
autopatch's own failure instead, for whoever wants to see it.
"""

from .. import env

_USERS = "__autopatch_raised_by_user_code__"


class fallback:
    """``with fallback(active, opt, "planning"):`` turns autopatch's failure into a fallback."""

    def __init__(self, active, opt, where):
        self.active, self.opt, self.where = active, opt, where

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        return error is not None and absorbed(self.active, self.opt, self.where, error)


def absorbed(active, opt, where, error):
    """``fallback`` as a function, for the per-step paths (``except Exception as error: if not
    absorbed(...): raise``), where a guard object per call would be most of the cost: True when
    ``error``, autopatch's own, became a fallback; False when it must propagate."""
    if not isinstance(error, Exception) or getattr(error, _USERS, False) or env.flag(env.STRICT):
        return False
    active.fall_back(opt, where, error)
    return True


def as_user_code(closure):
    """``closure`` marked as the user's: what it raises passes through the guard, and a second
    call returns the first call's loss (a fallback may need to run it after all)."""
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
