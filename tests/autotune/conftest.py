"""Autotune's tests time trials: one thread each, as two threads on two shared cores make step
times erratic and the search needs steady ones."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
