"""Autotune's tests time trials: one torch thread each (tests/conftest.py's ``one_thread``)."""

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield
