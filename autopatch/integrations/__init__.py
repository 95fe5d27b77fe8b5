"""Explicit switches for training frameworks: autopatch on for one fit, off again after it.

``autopatch.integrations.lightning`` and ``autopatch.integrations.huggingface`` import their
framework, on first use also as attributes (``autopatch.integrations.lightning.AutopatchCallback``);
this package and ``autopatch`` itself never do.
"""

import importlib
import warnings

import autopatch

_FRAMEWORKS = ("lightning", "huggingface")


def __getattr__(name):
    if name in _FRAMEWORKS:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class FitSession:
    """``enable()`` when a fit starts and ``disable()`` when it ends, for the callbacks.

    The policy is checked when the callback is built, so a bad one fails before training. If
    autopatch is already on (``FUSEDOPT_ENABLE=1``, an outer ``enable()``) it stays on, under its
    own policy, after the fit too.
    """

    def __init__(self, policy, overrides):
        from autopatch import policy as _policy
        _policy.load(policy, overrides=_policy.enable_overrides(overrides))   # raises PolicyError
        self.policy, self.overrides = policy, overrides
        self.owns = False

    def start(self):
        if self.owns:
            return   # still on from a fit that ended without telling us (it raised)
        if autopatch.is_enabled():
            if self.policy is not None or self.overrides:
                warnings.warn("autopatch is already enabled for this process; the callback keeps that "
                              "session and does not apply its own policy", RuntimeWarning, stacklevel=3)
            return
        autopatch.enable(self.policy, **self.overrides)
        self.owns = True

    def stop(self):
        if self.owns:
            self.owns = False
            autopatch.disable()
