"""One optimizer under autopatch with a runtime of its own, as ``enable()`` would adopt it, so
contenders under different policies (and unpatched ones) share a process and take turns."""

from autopatch import policy as ap_policy
from autopatch.runtime import Runtime


def adopt_alone(opt, policy, overrides=None):
    """``opt`` under ``policy`` (a builtin name or a path) with ``overrides``; returns its handle
    (mode, reason, describe(), set_mode()...)."""
    return Runtime(ap_policy.load(policy, overrides=overrides or {})).adopt(opt)


def assert_fused(handle, name):
    """autopatch really ran its fused step in mode multi_layer (not a silent fallback)."""
    fusion = handle.describe().get("fusion", {})
    assert handle.mode == "multi_layer" and fusion.get("fused_steps", 0) > 0, \
        f"{name}: autopatch did not run its fused step ({handle.reason})"


def auto_has_chosen(entry):
    """Mode auto has measured and chosen, per an optimizer's report entry (``describe()``)."""
    auto = entry.get("auto")
    return bool(auto) and "chosen" in auto and not auto["measuring"]
