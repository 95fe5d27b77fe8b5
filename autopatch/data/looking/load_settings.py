"""Where autopatch loads samples itself, it loads them as the user's loader would.

Three things about the process that loads decide what a deterministic dataset returns, beyond
the index: the global random generators (fixed seeds, restored afterwards: ``rng_states``), the
dataset's own generators (left as they were: ``side_copy.looking_at``), and torch's number of
threads, since reductions and FFTs split their work, and so round, by it. DataLoader workers run
one thread, the main process several; a sample autopatch compares with what a worker loaded must
be loaded with one thread too.
"""

import contextlib

import torch

from .rng_states import seeded
from .side_copy import looking_at

__all__ = ["loaded_as", "torch_threads", "loader_threads"]


def loader_threads(num_workers):
    """The torch threads a DataLoader with ``num_workers`` loads with."""
    return 1 if num_workers else torch.get_num_threads()


@contextlib.contextmanager
def torch_threads(count):
    before = torch.get_num_threads()
    if count != before:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if count != before:
            torch.set_num_threads(before)


@contextlib.contextmanager
def loaded_as(dataset, seed, threads):
    """A copy of ``dataset`` to load from under ``seed`` and ``threads``; everything restored after."""
    with seeded(seed), torch_threads(threads), looking_at(dataset) as source:
        yield source
