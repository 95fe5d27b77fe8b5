"""The run report: one JSON-serialisable dict, and the file ``FUSEDOPT_REPORT`` names."""

import json
import time

from .. import dist
from .files import folder_of

REPORT_VERSION = 1


def build_report(session, enabled):
    """``session``: the one open (or last open); per optimizer, the mode that ran and why, the
    run's timing, every section the rooms added (allreduce, autotune, breakdown, ...), and with
    a breakdown the advice it backs (reporting/advice/)."""
    if session is None:
        return {"version": REPORT_VERSION, "enabled": False, "policy": None, "optimizers": [],
                "timing": {}}
    optimizers = [o.describe() for o in session.optimizers]
    report = {
        "version": REPORT_VERSION,
        "enabled": enabled,
        "policy": session.policy.source,
        "rank": dist.rank(),
        "optimizers": optimizers,
        "timing": {
            "wall_seconds": round(time.perf_counter() - session.started, 6),
            "optimizer_step_seconds": round(sum(o["step_seconds"] for o in optimizers), 6),
            "steps": sum(o["steps"] for o in optimizers),
        },
        **session.report_sections(),
    }
    if "breakdown" in report:
        from .advice import advise
        report["advice"] = advise(report)
    return report


def report_path(template):
    """``{rank}`` in the path is this process's rank; without it only rank 0 writes."""
    r = dist.rank()
    if "{rank}" in template:
        return template.replace("{rank}", str(r))
    return template if r == 0 else None


def write_report(report, template):
    """The report at the path ``template`` gives this rank (None: this rank writes none), written
    whole or not at all, never through a link (reporting/files.py). Raises what fails."""
    path = report_path(template)
    if path is None:
        return None
    data = json.dumps(report, indent=2).encode()
    folder, name = folder_of(path)
    with folder:
        folder.write_whole(name, data)
    return path
