"""Gradients take much memory and backward fusion does not run: it would free each chunk's
gradients as soon as that chunk is updated, inside backward, instead of holding them all until
``step()``."""

from .figures import mib
from .thresholds import GRADIENT_MIB


def _why_not(o):
    """Why ``o`` does not run backward, from its report entry: ruled out, or auto measured it slower."""
    auto = o.get("auto") or {}
    blocked = (auto.get("ruled_out") or {}).get("backward")
    if blocked:
        return f"{o['class']}: backward was ruled out ({blocked})"
    ms = auto.get("ms_per_step") or {}
    if "backward" in ms and o["mode"] in ms:
        return (f"{o['class']}: auto measured backward at {ms['backward']:.3g} ms/step against "
                f"{o['mode']}'s {ms[o['mode']]:.3g}; FUSEDOPT_MODE=backward runs it anyway")
    return f"{o['class']} runs mode {o['mode']}; FUSEDOPT_MODE=backward runs backward fusion"


def advise(report):
    grad = report["breakdown"].get("gradient_bytes", 0)
    others = [o for o in report["optimizers"] if o["mode"] != "backward"]
    if grad < GRADIENT_MIB * 2**20 or not others:
        return []
    return [{"about": "memory", "advice":
             f"the gradients of the optimized parameters take {mib(grad)}; backward fusion frees each "
             f"chunk's gradients once it is updated inside backward, up to {mib(grad)} less at the step; "
             + "; ".join(_why_not(o) for o in others)}]
