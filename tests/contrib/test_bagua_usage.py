"""Bagua's documented usage works unchanged: the fused optimizer with with_bagua in both orders,
every rank starting from rank 0's optimizer state, QAdamOptimizer under fuse_step(), switching
algorithms by calling with_bagua again, a process group smaller than the world, and the stand-in
for bagua.torch_api (tests/support/bagua_usage_worker.py holds the calls as Bagua's scripts make them)."""

import pytest

from harness.launch import failed, run_ranks
from spawn import IMPORT_PATH, SUPPORT, patience

WORKER = SUPPORT / "bagua_usage_worker.py"


@pytest.fixture(scope="module")
def main_suite():
    ranks = run_ranks([WORKER, "main"], 2, timeout=patience(300), env={"PYTHONPATH": IMPORT_PATH})
    assert failed(ranks) is None, failed(ranks)
    return [r.results for r in ranks]


@pytest.mark.parametrize("case", [f"{a}_{o}" for a in ("gradient_allreduce", "bytegrad", "decentralized")
                                  for o in ("sgd", "adam")])
def test_fuse_optimizer_then_with_bagua_fuses_and_equals_unfused(main_suite, case):
    """The docs' order: opt = fuse_optimizer(opt); model.with_bagua([opt], algorithm,
    do_flatten=False); opt.fuse_step(); bitwise equal to step() every step, every step fused
    (once per fuse_step call, two param groups each)."""
    for rank in main_suite:
        run = rank["fused"][case]
        assert run["equal"] and run["fused_steps"] == 6, run


def test_with_bagua_then_fuse_optimizer_still_runs_the_algorithm(main_suite):
    """The examples' order with low-precision decentralized, whose exchange follows each step:
    it used to never exchange once fuse_optimizer took the optimizer's hooks off."""
    for rank in main_suite:
        run = rank["fused"]["low_precision_bagua_first"]
        assert run["communications"] == 12 and run["equal"] and run["fused_steps"] == 6, run


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "rprop"])
def test_every_rank_starts_from_rank_0s_model_and_optimizer_state(main_suite, optimizer):
    for rank in main_suite:
        got = rank["broadcast"][optimizer]
        assert got["weights"] and got["state"] and got["lr"] == 0.2, got


def test_qadam_optimizer_under_fuse_step_equals_step(main_suite):
    assert all(rank["qadam"]["equal"] for rank in main_suite)


def test_switching_algorithms_keeps_one_wrapper_and_one_algorithm(main_suite):
    for rank in main_suite:
        s = rank["switch"]
        assert s["one_wrapper"] and s["not_nested"] and s["models"] == 1 and s["identical"], s
        assert s["running"] is None, s      # the last, gradient allreduce, has no algorithm object


def test_a_bagua_script_runs_through_the_stand_in_for_bagua_torch_api(main_suite):
    assert [(r["shim"]["rank"], r["shim"]["world"], r["shim"]["identical"]) for r in main_suite] == \
        [(0, 2, True), (1, 2, True)]


def test_a_process_group_smaller_than_the_world_never_waits_for_the_others():
    """Ranks 0 and 1 train over their own group (mode auto measuring and agreeing within it);
    rank 2, outside it, trains its own model and exits first: no hang, no closed connection."""
    ranks = run_ranks([WORKER, "group"], 3, timeout=patience(180), env={"PYTHONPATH": IMPORT_PATH})
    assert failed(ranks) is None, failed(ranks)
    results = [r.results for r in ranks]
    assert [r["outside"] for r in results] == [False, False, True]
    assert results[0]["chose"] and results[0]["mode"] == results[1]["mode"]
