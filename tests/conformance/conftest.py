"""The conformance suite's marker, its deselection by default, and its summary.

``conformance_full`` marks the full cross product (every variant x scenario x configuration); a
plain ``pytest`` deselects it, ``pytest -m conformance_full`` runs it.
"""

import pytest

from .runner import UNPATCHED

FULL = "conformance_full"


def _marker_expression(config):
    return config.getoption("-m", default="") or ""


def pytest_collection_modifyitems(config, items):
    if FULL in _marker_expression(config):
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker(FULL) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_terminal_summary(terminalreporter):
    if not UNPATCHED:
        return
    tr = terminalreporter
    tr.section("conformance: optimizers autopatch left unpatched, with its reason (recorded, not failed)")
    for (cls, reason), n in sorted(UNPATCHED.items(), key=lambda kv: (kv[0][0] or "", -kv[1])):
        tr.write_line(f"{n:5d} case(s)  {cls}: {reason}")


@pytest.fixture
def conformance(ap, record_property):
    """autopatch, off again after the test (tests/conftest.py's ``ap``), and the property recorder."""
    return ap, record_property


@pytest.fixture(scope="module", autouse=True)
def frozen_heap():
    """Every case collects garbage several times (the dropped optimizers must be gone), and so does
    autopatch's enable(); torch's optimizer database and the collected items make that heap large
    (a full collection took 0.3 s here). Objects alive before the first case are moved out of the
    collector's reach for the module's duration (``gc.freeze``), so a collection walks only what
    the cases build. Nothing a case builds is frozen.

    The cases' tensors are tiny: one torch thread runs them faster than two, and far faster on a
    loaded machine (both runs of a case use the same thread count)."""
    import gc

    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
    torch.set_num_threads(threads)
