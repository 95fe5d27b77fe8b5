"""Ranks that step unevenly never hang on a decision of autopatch's: async's ranks, one stopping
at step 30 and the other running to 90 while mode auto measures (the default policy with
``FUSEDOPT_ALGORITHM=async``), three jobs in a row (ten in the measurements of RESULTS.md) on a machine kept busy by another process. Every
job ends by itself, as it would unpatched, with both ranks' weights saved. The process group's
timeout is 15 minutes, so a wait on a rank that will not come shows as a job that does not end
within its two minutes (``torchrun_job.Running``), not as gloo's timeout."""

import subprocess
import sys

import pytest

from torchrun_job import run_all

RUNS = 3
BUSY = "import time\nend = time.monotonic() + 600\nwhile time.monotonic() < end:\n    pass\n"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("uneven")
    busy = subprocess.Popen([sys.executable, "-c", BUSY])     # another user's work on the machine
    try:
        return run_all({i: ("default", root / f"run{i}", dict(
            timeout=120, fault="finish", fault_rank=0, fault_step=30, steps=90, FAULT_PAUSE=0.002, FAULT_PG_TIMEOUT=900,
            FUSEDOPT_ALGORITHM="async")) for i in range(RUNS)})
    finally:
        busy.kill()
        busy.wait()


@pytest.mark.parametrize("run", range(RUNS))
def test_async_ranks_stepping_30_and_90_times_end_the_job(jobs, run):
    job = jobs[run]
    saved = sorted(p.name for p in job.out.glob("rank*.pt"))
    assert job.returncode == 0 and saved == ["rank0.pt", "rank1.pt"], (saved, job.log[-3000:])
    assert job.leftovers == [] and job.orphans == [], (job.leftovers, job.orphans)
    print(f"run {run}: ended {job.after_fault:.1f} s after rank 0 stopped")
