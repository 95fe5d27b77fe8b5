"""Async averaging when ranks stop at different times, with TensorBoard logging on and off: a rank
raising at step 100 of 400 (rank 0 or rank 1) makes the other raise too and the job end, and a rank that
finishes early normally keeps averaging until the other finishes, then both exit cleanly, their
weights saved. Nothing hangs and nothing is left behind. Logging goes on for one of the two
raising ranks, and both ways for the early finish."""

import pytest

from torchrun_job import run_all

ORDERS = {"rank 0 raises": dict(fault="raise", fault_rank=0), "rank 1 raises": dict(fault="raise", fault_rank=1),
          "rank 0 finishes early": dict(fault="finish", fault_rank=0)}
LOGGING = {"rank 0 raises": (False,), "rank 1 raises": (True,), "rank 0 finishes early": (False, True)}
CASES = [(order, logging) for order in ORDERS for logging in LOGGING[order]]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("async_orders")
    jobs = {}
    for order, fault in ORDERS.items():
        for logging in LOGGING[order]:
            out = root / f"{order.replace(' ', '_')}-{'tb' if logging else 'plain'}"
            extra = {"FUSEDOPT_LOGDIR": out / "tb"} if logging else {}
            jobs[order, logging] = ("async", out, dict(fault_step=100, steps=400, **fault, **extra))
    return run_all(jobs)


@pytest.mark.parametrize("order, logging", CASES,
                         ids=[f"{o}-logging {'on' if g else 'off'}" for o, g in CASES])
def test_async_exit_order(jobs, order, logging):
    job = jobs[order, logging]
    saved = sorted(p.name for p in job.out.glob("rank*.pt"))
    if "raises" in order:
        assert job.returncode != 0 and saved == [], (saved, job.log[-3000:])
        other = 1 - ORDERS[order]["fault_rank"]
        assert f"[rank{other}]: autopatch.comm.algorithms.async_average.PeerGone" in job.log, job.log[-3000:]
    else:
        assert job.returncode == 0 and saved == ["rank0.pt", "rank1.pt"], (saved, job.log[-3000:])
    assert job.leftovers == [] and job.orphans == [], (job.leftovers, job.orphans)
    if logging:
        assert (job.out / "tb" / "autopatch.jsonl").exists()
    print(f"async, {order}, logging {'on' if logging else 'off'}: ended {job.after_fault:.1f} s after it")
