"""Exposed communication waits stand out: what bytegrad would send instead, at the bytes per step
the gradient sync measured. Only autopatch's own sync is seen (under DDP's own reducer the waits
are inside backward): without its figures there is no advice."""

from .figures import share_of_step
from .thresholds import COMM_SHARE

QUARTER = ("minmax_uint8",)      # compressions that already send 8-bit codes


def advise(report):
    sync = report.get("allreduce") or {}
    algorithm = sync.get("algorithm")
    if report["breakdown"]["share"]["comm"] < COMM_SHARE or not sync.get("active") or not algorithm:
        return []
    if algorithm["name"] != "gradient_allreduce" or algorithm["settings"].get("compression") in QUARTER:
        return []
    sent = algorithm["bytes_sent_per_step"]
    return [{"about": "comm", "advice":
             f"waiting on communication (not overlapped with backward) is {share_of_step(report, 'comm')} "
             f"at {sent} bytes sent per step: FUSEDOPT_ALGORITHM=bytegrad would send about {sent // 4} "
             "(gradients as 8-bit min-max codes), and changes results by design (each averaged "
             "gradient within a code step of DDP's)"}]
