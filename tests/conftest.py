"""Fixtures: an autopatch that is off again after each test, and the installed package's .pth line."""

import gc
import os
import shutil

import pytest
import torch

import autopatch
from spawn import short_temp_dir, site_packages


@pytest.fixture(autouse=True)
def earlier_objects_frozen():
    """What earlier tests left in a worker is moved out of the garbage collector's reach for the
    test (``gc.freeze``): a test's collections, and autopatch's own when it looks for live
    objects, then walk only what the test built, instead of a heap that takes a second or more
    to walk late in the suite. The test's own garbage is collected as it ends, then the rest goes
    back to the collector."""
    gc.freeze()
    yield
    gc.collect()
    gc.unfreeze()


@pytest.fixture
def ap(monkeypatch):
    """autopatch with no FUSEDOPT_* variable in effect, disabled again however the test ends."""
    for k in list(os.environ):
        if k.startswith("FUSEDOPT_"):
            monkeypatch.delenv(k)
    autopatch.disable()
    yield autopatch
    autopatch.disable()


@pytest.fixture
def installed():
    """The zero-code tests need this interpreter to carry the package's .pth line."""
    pth = site_packages() / "autopatch.pth"
    assert pth.is_file(), f"{pth} is missing: install the package (pip install -e .) first"
    return pth


@pytest.fixture
def child_tmpdir():
    """An empty directory, with a short path, for a child process's ``TMPDIR`` (spawn.short_temp_dir)."""
    path = short_temp_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def one_thread():
    """One torch thread for the test: two threads on two shared cores make step times erratic,
    and tests that time steps (autotune's trials, TensorBoard's windows) need steady ones."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def digits_file(tmp_path_factory):
    """The digits saved once and named in the environment every rank process inherits."""
    import digits_data
    path = tmp_path_factory.mktemp("digits") / "digits.pt"
    digits_data.save(path)
    os.environ[digits_data.VARIABLE] = str(path)
    yield path
    del os.environ[digits_data.VARIABLE]
