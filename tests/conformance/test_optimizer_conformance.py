"""Optimizer conformance: every torch optimizer, run unpatched and under autopatch, trains alike.

Durations on this project's shared 2-core machine (torch 2.13.0 CPU, 2026-11-25, run under
``nice -n 10`` while other work kept the load average at 8-11):

- default run (the sample below, 139 cases): 1 min 12 s wall, 48 s CPU, with Inductor's cache
  warm; 2 min 22 s wall, 66 s CPU with it cold (policy fast compiles one optimizer's step);
- full cross product (``-m conformance_full``, 105,120 cases): one shard of 200
  (``CONFORMANCE_SHARD=1/200``, 576 cases) took 8 min 5 s wall, 4 min 17 s CPU, so about 27 hours
  wall (14 hours CPU) for all of it here: run it as shards, in parallel where there are cores.

Cases are generated from torch's optimizer database (optim_cases.py): each OptimizerInfo's CPU
inputs (maximize among them) x implementations (for-loop, foreach, fused where torch has a CPU
kernel) x parameter kinds (dense, non-contiguous, complex where supported, sparse gradients where
supported) x learning rate (as given, as a tensor); ``differentiable`` and ``capturable`` are left
out (torch lists capturable inputs for accelerators only). Each case runs one script
(scenarios.py: plain steps, a param group added, state_dict round trips named and unnamed and
across patched and unpatched runs, deepcopy, step hooks, LR schedulers, SWA, optimizers dropped
and re-created, two optimizers over a model's halves, the script's own torch function mode)
unpatched and under one configuration (runner.py: modes off, multi_layer, backward and forward,
each of those two also with ``observe_steps: 1``, the default policy, auto racing the modes,
policy fast), and checks weights, ``opt.state``, ``state_dict()``, hook calls, and that nothing is
left behind: torch's mode stack, global module and optimizer hooks, gradient hooks, optimizers kept
alive, objects not restored by ``disable()``.

The default run takes a deterministic sample, a Latin square per optimizer: each optimizer runs
every scenario once, the configuration rotating with the scenario and the optimizer, so every
optimizer meets every configuration and every (scenario, configuration) pair meets at least one
optimizer; each slot takes the next variant, strata (implementation x kind x learning rate)
taking turns in an order fixed by a stable hash. Policy fast compiles the update of optimizers
without a fused kernel (tens of seconds per class on this machine), so the sample runs it for the
optimizers with a fused CPU kernel and, for the compiled route, once for the first other optimizer
of the database. The full cross product is marked ``conformance_full`` and deselected by default:

    PYTHONPATH=$PWD python -m pytest -q -p no:cacheprovider tests/conformance              # sample
    PYTHONPATH=$PWD python -m pytest -q -p no:cacheprovider tests/conformance -m conformance_full
    CONFORMANCE_SHARD=3/200 PYTHONPATH=$PWD python -m pytest -q -p no:cacheprovider tests/conformance -m conformance_full

``CONFORMANCE_SHARD=i/n`` runs the i-th of n shards of the full product (its (variant, scenario)
pairs split by a stable hash, each in every configuration). ``CONFORMANCE_FINDINGS=path`` appends
every failing case's findings there as JSON lines (one per case, each finding with its category).
"""

import os

import pytest

from .optim_cases import optim_db, fused_on_cpu, stable_hash, torch_rejects, torch_skip, variants
from .runner import CONFIGS, Case, fail_on_findings, run_case
from .scenarios import SCENARIOS, applies

FULL = "conformance_full"


def _is_case(variant, scenario):
    return applies(scenario, variant) is None and torch_rejects(variant) is None and torch_skip(variant, scenario) is None


def _compiled_fast_class():
    """The optimizer whose compiled route policy fast exercises in the default run."""
    return next(info.name for info in optim_db if not fused_on_cpu(info) and not info.step_requires_closure)


SLOTS_PER_SCENARIO = 1    # configurations per (optimizer, scenario) in the default sample


def _stratified(info):
    """The optimizer's variants, strata (implementation x parameter kind x learning rate) taking
    turns, each stratum in an order fixed by a stable hash: the first picks cover every stratum."""
    strata = {}
    for v in sorted(variants(info), key=lambda v: stable_hash("order", v.id)):
        strata.setdefault((v.impl, v.kind, v.lr), []).append(v)
    order = sorted(strata, key=lambda k: stable_hash("stratum", info.name, k))
    out = []
    for i in range(max(len(vs) for vs in strata.values())):
        out += [strata[k][i] for k in order if i < len(strata[k])]
    return out


def default_sample():
    """Per optimizer, every scenario in SLOTS_PER_SCENARIO configurations, the configurations
    rotating with the scenario and the optimizer (a Latin square: every optimizer meets every
    configuration and every scenario, and every (scenario, configuration) pair meets several
    optimizers); each slot takes the next variant that is a case for it."""
    configs = list(CONFIGS.values())
    cases = []
    compiled_taken = False
    for c, info in enumerate(optim_db):
        pool = _stratified(info)
        j = 0
        for s, scenario in enumerate(SCENARIOS):
            for rep in range(SLOTS_PER_SCENARIO):
                config = configs[(s + c + rep * (len(configs) // SLOTS_PER_SCENARIO)) % len(configs)]
                if config.name == "fast" and not fused_on_cpu(info):
                    if info.name != _compiled_fast_class() or compiled_taken:
                        continue
                    compiled_taken = True
                pick = pool[j % len(pool)]
                for k in range(len(pool)):
                    v = pool[(j + k) % len(pool)]
                    if _is_case(v, scenario):
                        pick, j = v, j + k
                        break
                j += 1
                cases.append(Case(pick, scenario, config))
    return cases


def full_product(shard=None):
    """Every variant x scenario x configuration; ``shard`` "i/n" keeps the (variant, scenario)
    pairs a stable hash puts in shard i of n (1-based), each with all its configurations (they
    share the unpatched run), so the full product can be split across processes or machines."""
    groups = [(v, scenario) for info in optim_db for v in variants(info) for scenario in SCENARIOS]
    if shard:
        i, n = (int(x) for x in shard.split("/"))
        groups = [g for g in groups if stable_hash("shard", g[0].id, g[1]) % n == i - 1]
    return [Case(v, scenario, config) for v, scenario in groups for config in CONFIGS.values()]


def pytest_generate_tests(metafunc):
    if "case" not in metafunc.fixturenames:
        return
    if metafunc.function.__name__ == "test_full":
        wanted = FULL in (metafunc.config.getoption("-m", default="") or "")
        cases = full_product(os.environ.get("CONFORMANCE_SHARD")) if wanted else []
        if not cases:
            # Collected only when asked for: the full product has tens of thousands of cases.
            metafunc.parametrize("case", [pytest.param(None, id="not-collected")])
            return
    else:
        cases = default_sample()
    metafunc.parametrize("case", cases, ids=[c.id for c in cases])


def test_sample(case, conformance):
    fail_on_findings(run_case(case, *conformance))


@pytest.mark.conformance_full
def test_full(case, conformance):
    if case is None:
        pytest.skip("run with -m conformance_full to collect the full cross product")
    fail_on_findings(run_case(case, *conformance))
