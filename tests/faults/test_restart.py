"""``torchrun --max-restarts=1`` with a worker SIGKILLed once: the restarted workers resume from
the script's own checkpoint (model and optimizer state_dicts, saved every 5 steps) and end with
the same weights as an uninterrupted plain DDP run, bit for bit, under plain DDP, the default
policy, autotune with 50 ms trials, so that trials run before and after the kill (autotune
keeps nothing across the restart: the restarted workers search again, and every mode they try
gives the same results), and sharded optimizer state (the builtin policy ``sharded``: every rank
asks for the state_dict, which gathers the shares, and rank 0 saves it; the restarted workers
load the whole state and shard it again).

torch 2.13's torchrun shares its own TCPStore with the workers of every attempt, and the gloo
addresses the first attempt left in it make the restarted workers connect to ranks long gone
(``connectFullMesh ... Connection refused``, plain DDP alike): these jobs set
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, torch's switch for a store of each attempt's own."""

import json

import pytest
import torch

from torchrun_job import run_all

CONTENDERS = ("ddp", "default", "autotune", "sharded")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("restart")
    jobs = {}
    for c in CONTENDERS:
        for killed in (False, True) if c == "ddp" else (True,):
            out = root / f"{c}-{'killed' if killed else 'whole'}"
            jobs[c, killed] = (c, out, dict(fault="kill" if killed else "none", fault_rank=1, fault_step=42, steps=60,
                                            restarts=1, FAULT_CHECKPOINT=out / "checkpoint.pt", FAULT_EVERY=5,
                                            TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, FUSEDOPT_AUTOTUNE_TRIAL_SECONDS=0.05,
                                            FUSEDOPT_REPORT=out / "report_{rank}.json"))
    return run_all(jobs)


@pytest.mark.parametrize("contender", CONTENDERS)
def test_a_restarted_job_ends_as_an_uninterrupted_one(jobs, contender):
    whole, killed = jobs["ddp", False], jobs[contender, True]
    assert whole.returncode == 0 and killed.returncode == 0, killed.log[-3000:]
    assert "(exitcode: -9)" in killed.log, killed.log[-3000:]     # killed once, then restarted
    for rank in (0, 1):
        a, b = (torch.load(job.out / f"rank{rank}.pt") for job in (whole, killed))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (contender, rank)
    assert killed.leftovers == [] and killed.orphans == [], (killed.leftovers, killed.orphans)
    if contender == "sharded":        # the restarted workers (their reports replace the first's)
        for rank in (0, 1):
            [opt] = json.loads((killed.out / f"report_{rank}.json").read_text())["optimizers"]
            assert opt["shard"]["active"] is True and opt["shard"]["ranks"] == 2, opt
            assert opt["shard"]["state_dicts_served"] == (4 if rank == 0 else 0), opt   # saves at 45..60
