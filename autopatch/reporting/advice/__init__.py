"""Advice at the end of a run, each line backed by a figure the report holds, never a guess.

Each idea is a module of its own with one function ``advise(report)`` that reads only the report
(its ``breakdown``, ``optimizers``, ``allreduce`` and ``data`` sections) and returns advice
entries, ``{"about": part, "advice": text}``, or none when its part does not stand out
(``thresholds.py`` says when a part does). Nothing here measures or changes anything.
"""

from . import data_wait, exposed_comm, gradient_memory, optimizer_fusion, own_work

IDEAS = (data_wait, exposed_comm, optimizer_fusion, gradient_memory, own_work)


def advise(report):
    """Every idea's advice for this report, in the order of ``IDEAS``; [] with no breakdown."""
    breakdown = report.get("breakdown") or {}
    if not breakdown.get("steps"):
        return []
    return [entry for idea in IDEAS for entry in idea.advise(report)]
