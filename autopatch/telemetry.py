"""The run report (JSON-serialisable) and its short human summary."""

import json
import os
import sys
import time

REPORT_VERSION = 1


def rank():
    """This process's rank: torch.distributed when initialised, else torchrun's RANK, else 0."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def build_report(runtime, enabled):
    if runtime is None:
        return {"version": REPORT_VERSION, "enabled": False, "policy": None, "optimizers": [],
                "timing": {}}
    optimizers = [c.describe() for c in runtime.controllers]
    return {
        "version": REPORT_VERSION,
        "enabled": enabled,
        "policy": runtime.policy.source,
        "rank": rank(),
        "optimizers": optimizers,
        "timing": {
            "wall_seconds": round(time.perf_counter() - runtime.started, 6),
            "optimizer_step_seconds": round(sum(o["step_seconds"] for o in optimizers), 6),
            "steps": sum(o["steps"] for o in optimizers),
        },
        **{name: describe() for name, describe in runtime.sections.items()},
    }


def summary(report):
    lines = [f"autopatch: policy {report['policy']}, {len(report['optimizers'])} optimizer(s)"]
    for o in report["optimizers"]:
        ms = 1e3 * o["step_seconds"] / o["steps"] if o["steps"] else 0.0
        lines.append(f"  {o['class']}: {o['mode']} over {o['params']} params, {o['steps']} steps, "
                     f"{ms:.3f} ms/step - {o['reason']}")
        route = o.get("route")
        if route and route["deviation"] is not None:
            lines.append(f"    route {route['route']}: probe deviation {route['deviation']:.2g} (relative, "
                         f"bound {route['bound']:.2g}) - {route['why']}")
        elif route and route["why"] != "fusion.exact: bitwise":
            lines.append(f"    route {route['route']} - {route['why']}")
        auto = o.get("auto")
        if auto and auto.get("ms_per_step"):
            times = ", ".join(f"{m} {t:.3f}" for m, t in auto["ms_per_step"].items())
            lines.append(f"    auto measured whole training steps ({times} ms/step; chose {auto['chosen']}, "
                         f"{auto['speedup_vs_off']:.2f}x unpatched), spending {auto['measure_steps']} steps "
                         f"({auto['measure_seconds']:.2f} s) measuring over {len(auto['measurements'])} "
                         f"measurement(s) of at most {auto['measure_steps_limit']} steps")
        for i in o.get("incidents", []):
            lines.append(f"    step {i['step']}: left {i['left']} for {i['for']}: {i['what']}"
                         + (" (that step's update differs from unpatched)" if i["update_differs"] else ""))
    return "\n".join(lines)


def report_path(template):
    """``{rank}`` in the path is this process's rank; without it only rank 0 writes."""
    r = rank()
    if "{rank}" in template:
        return template.replace("{rank}", str(r))
    return template if r == 0 else None


def write_report(report, template):
    path = report_path(template)
    if path is None:
        return None
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    return path
