"""Fixtures: an autopatch that is off again after each test, and the installed package's .pth line."""

import os

import pytest
import torch

import autopatch
from spawn import site_packages


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
def one_thread():
    """One torch thread for the test: two threads on two shared cores make step times erratic,
    and tests that time steps (autotune's trials, TensorBoard's windows) need steady ones."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
