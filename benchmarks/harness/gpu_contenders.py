"""The contenders of the GPU runs: unpatched, with torch's options, or under an autopatch policy."""

from dataclasses import dataclass

import autopatch

from .gpu_workloads import WORKLOADS

EXACT_MODES = ("multi_layer", "backward", "forward", "auto")   # must train bit for bit like unpatched


@dataclass(frozen=True)
class Contender:
    name: str
    label: str
    policy: object = None     # autopatch.enable(policy, **overrides); None: unpatched
    overrides: tuple = ()
    options: tuple = ()       # keyword arguments of the optimizer

    def enable(self):
        if self.policy is not None:
            autopatch.enable(self.policy, **dict(self.overrides))


def fusion_mode(mode, name=None, label=None, **overrides):
    """An autopatch contender: the default policy with ``fusion.mode`` (and more) overridden."""
    return Contender(name or mode, label or f"autopatch {mode}", "default",
                     tuple({"mode": mode, **overrides}.items()))


UNPATCHED = Contender("unpatched", "unpatched (torch default)")


def unavailable(key, contender):
    """None, or why this contender has no entry for the workload."""
    if contender.options and WORKLOADS[key].optimizer == "BertAdam":
        return "the hand-written optimizer has no foreach/fused option"
    return None
