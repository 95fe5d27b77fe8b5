"""autopatch's own work stands out and autotune's search is what took it: the config it saved
applies to the next run without searching."""

from .figures import share_of_step
from .thresholds import OWN_WORK_SHARE


def advise(report):
    tune = report.get("autotune") or {}
    cost = tune.get("cost") or {}
    if report["breakdown"]["share"]["autopatch"] < OWN_WORK_SHARE or not tune.get("active") or not cost:
        return []
    text = (f"autopatch's own work is {share_of_step(report, 'autopatch')}, and autotune's search took "
            f"{cost['search_seconds']:.3g} s ({cost['decision_seconds']:.3g} s of it deciding)")
    if tune.get("best_json"):
        text += f": FUSEDOPT_AUTOTUNE_RESUME={tune['best_json']} applies its best config to the next run without searching"
    return [{"about": "autopatch", "advice": text}]
