"""Bagua's documented usage works unchanged: the fused optimizer with with_bagua in both orders
(every algorithm, fuse_step() alone or with step(); Bagua's mnist example with qadam), every rank starting from rank 0's optimizer state, QAdamOptimizer under fuse_step(), switching
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


@pytest.mark.parametrize("algorithm", ["gradient_allreduce", "bytegrad", "decentralized",
                                       "low_precision_decentralized", "qadam"])
@pytest.mark.parametrize("order", ["fuse_first", "bagua_first"])
@pytest.mark.parametrize("stepping", ["fuse_step", "alternate"])
def test_every_algorithm_runs_under_fuse_step_in_either_order(main_suite, algorithm, order, stepping):
    """The flat chunks fuse_step() steps stand for the model's own parameters: the algorithm is
    kept (qadam was dropped as 'updates parameters outside this model' when the first step was a
    fuse_step()), and the weights equal step()'s bit for bit."""
    for rank in main_suite:
        run = rank["orders"][f"{algorithm}_{order}_{stepping}"]
        assert run["running"] == run["plain_running"] and run["equal"] and run["fused_steps"] == 12 // (
            1 if stepping == "fuse_step" else 2), run
        assert run["running"] == (None if algorithm in ("gradient_allreduce", "bytegrad") else algorithm), run


@pytest.fixture(scope="module", params=[2, 3], ids=["2_ranks", "3_ranks"])
def mnist_qadam(request):
    """Bagua's examples/mnist order (QAdamOptimizer, with_bagua, fuse_optimizer, fuse_step() in the
    loop), and the same job without --fuse-optimizer, on 2 and 3 ranks."""
    ranks = run_ranks([WORKER, "mnist_qadam"], request.param, timeout=patience(240), env={"PYTHONPATH": IMPORT_PATH})
    assert failed(ranks) is None, failed(ranks)
    return request.param, [r.results for r in ranks]


def test_bagua_mnist_example_runs_qadam_with_fuse_optimizer(mnist_qadam):
    """qadam runs past its warm-up with no warning, every step fused, replicas identical."""
    for rank in mnist_qadam[1]:
        fused = rank["fused"]
        assert fused["warnings"] == [] and fused["fused_steps"] == 10, fused
        assert fused["algorithm"]["algorithm"] == "qadam" and fused["algorithm"]["phase"] == "compressing", fused
        assert fused["algorithm"]["steps"] == rank["plain"]["algorithm"]["steps"] == 10, rank
        assert rank["identical"], rank


def test_bagua_mnist_example_with_fuse_optimizer_equals_without(mnist_qadam):
    """Bit for bit, at 3 ranks too: the 8-bit average codes the step directions in rows, and
    fuse_step()'s chunks come in the planner's run order, not the optimizer's, so the rows held
    other elements than step()'s until the directions were laid out by parameter."""
    assert all(rank["equal"] for rank in mnist_qadam[1]), mnist_qadam[1]


def test_qadam_under_fuse_step_equals_step_for_parameters_in_every_memory_order(mnist_qadam):
    for rank in mnist_qadam[1]:
        got = rank["layouts"]
        assert got["equal"] and got["strides"] and got["fused_steps"] == 8, got


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
