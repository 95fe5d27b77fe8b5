"""Run a block under fixed seeds of every global generator a dataset may draw from, and put each
state back afterwards, so that looking at samples leaves the training's randomness untouched.

Covered: Python's ``random``, NumPy's legacy global generator (when NumPy is loaded), torch's CPU
generator and, once CUDA is initialised, every CUDA generator. ``torch.manual_seed`` is avoided
on purpose: it would also queue a seed for a CUDA that is not initialised yet, changing the run's
CUDA randomness later.
"""

import contextlib
import random
import sys

import torch

__all__ = ["seeded"]


@contextlib.contextmanager
def seeded(seed):
    np = sys.modules.get("numpy")
    cuda = torch.cuda.is_initialized()
    saved = (random.getstate(), np.random.get_state() if np else None, torch.get_rng_state(),
             torch.cuda.get_rng_state_all() if cuda else None)
    random.seed(seed)
    if np:
        np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    if cuda:
        torch.cuda.manual_seed_all(seed)
    try:
        yield
    finally:
        random.setstate(saved[0])
        if np:
            np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
        if cuda:
            torch.cuda.set_rng_state_all(saved[3])
