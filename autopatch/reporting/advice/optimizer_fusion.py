"""The optimizer step stands out over many tensors: per optimizer, what kept its step from being
fused or from running inside backward, as the report gives it, and how to allow it where the
reason is one autopatch knows the way around."""

from .figures import share_of_step
from .thresholds import OPTIMIZER_MIN_TENSORS, OPTIMIZER_SHARE

FUSED = ("multi_layer", "backward", "forward")
# What ruled a mode out (a phrase of its reason) -> how to allow it.
WAYS_AROUND = {
    "closure": "call loss.backward() before optimizer.step() instead of passing step() a closure",
    "accumulat": "step after every backward (no gradient accumulation) for backward fusion",
}


def _ways(reasons):
    return [way for phrase, way in WAYS_AROUND.items() if any(phrase in r for r in reasons)]


def advise(report):
    share = report["breakdown"]["share"]["optimizer"]
    if share < OPTIMIZER_SHARE:
        return []
    out = []
    for o in report["optimizers"]:
        if o["params"] < OPTIMIZER_MIN_TENSORS or o["mode"] == "backward":
            continue
        ruled_out = (o.get("auto") or {}).get("ruled_out") or {}
        if o["mode"] in FUSED and not ruled_out:
            continue      # fused, and nothing kept it from the other modes: nothing to say
        why = "; ".join(f"{m}: {r}" for m, r in ruled_out.items()) or o["reason"]
        running = f"runs unfused (mode {o['mode']})" if o["mode"] not in FUSED else f"runs {o['mode']}"
        text = (f"the optimizer step is {share_of_step(report, 'optimizer')} over {o['params']} tensors, and "
                f"{o['class']} {running}; ruled out: {why}")
        ways = _ways([why])
        if ways:
            text += f"; to allow it: {'; '.join(ways)}"
        out.append({"about": "optimizer", "advice": text})
    return out
