"""A rank that raises, or is SIGKILLed, mid-training ends the whole torchrun job, under every
communication algorithm as under plain DDP: no other rank trains on to its last step alone, and
nothing of autopatch is left behind (no process, no autopatch-* in the temp dir). Plain DDP
meets both faults, each algorithm one of them (``torchrun_job.cases``: not the encoding
variants, which run their base algorithm's code), three jobs at a time; the
fault comes at step 20 of 500."""

import pytest

from torchrun_job import cases, run_all

CASES = cases(("raise", "kill"))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rank_failure")
    return run_all({(c, f): (c, root / f"{c}-{f}", dict(fault=f, fault_rank=1, fault_step=20, steps=500))
                    for c, f in CASES})


@pytest.mark.parametrize("contender, fault", CASES, ids=[f"{c}-{f}" for c, f in CASES])
def test_the_job_ends_and_leaves_nothing(jobs, contender, fault):
    job = jobs[contender, fault]
    assert job.returncode != 0, job.log[-3000:]
    assert not list(job.out.glob("rank*.pt")), f"a rank trained on to its end alone:\n{job.log[-3000:]}"
    assert job.leftovers == [] and job.orphans == [], (job.leftovers, job.orphans)
    print(f"{contender} {fault}: the job ended {job.after_fault:.1f} s after the fault")
