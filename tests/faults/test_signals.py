"""SIGTERM or SIGINT sent to a torchrun job mid-step ends it, under every communication algorithm
as under plain DDP: torchrun passes the signal on, the script's own handler (when it has one)
runs on every rank, and nothing of autopatch is left behind. Plain DDP gets SIGTERM with the
script's handler and SIGINT without, each algorithm one of the two (``torchrun_job.cases``: not
the encoding variants, which run their base algorithm's code);
async, whose exit waits for the other ranks unless the script died of an exception, gets all
four."""

import signal

import pytest

from torchrun_job import cases, run_all

CASES = [(c, s, h) for c, (s, h) in cases(((signal.SIGTERM, True), (signal.SIGINT, False)))]
CASES += [("async", s, h) for s in (signal.SIGTERM, signal.SIGINT) for h in (True, False)
          if ("async", s, h) not in CASES]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("signals")
    return run_all({case: (case[0], root / f"{case[0]}-{case[1].name}-{int(case[2])}",
                           dict(fault="ready", fault_step=20, steps=100_000, signal_to_send=case[1],
                                FAULT_HANDLER=int(case[2])))
                    for case in CASES})


@pytest.mark.parametrize("contender, sig, handler", CASES,
                         ids=[f"{c}-{s.name}-{'handler' if h else 'default'}" for c, s, h in CASES])
def test_the_job_ends_and_the_handler_runs(jobs, contender, sig, handler):
    job = jobs[contender, sig, handler]
    assert job.returncode != 0 and not list(job.out.glob("rank*.pt")), job.log[-3000:]
    handled = {p.name: p.read_text() for p in job.out.glob("handled.rank*")}
    assert handled == ({"handled.rank0": sig.name, "handled.rank1": sig.name} if handler else {}), job.log[-3000:]
    assert job.leftovers == [] and job.orphans == [], (job.leftovers, job.orphans)
    print(f"{contender} {sig.name} ({'handler' if handler else 'default'}): ended {job.after_fault:.1f} s after it")
