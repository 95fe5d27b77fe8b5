"""Fixtures: an autopatch that is off again after each test, and the installed package's .pth line."""

import os

import pytest

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
