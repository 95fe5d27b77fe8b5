"""scikit-learn's handwritten digits as tensors, for rank processes: the test session saves them
once (``save``) and names the file in ``DIGITS_FILE``; a rank loads that file instead of importing
scikit-learn, which costs each process about 2 s of CPU, as much as its whole training."""

import os

import torch

VARIABLE = "DIGITS_FILE"


def save(path):
    torch.save(_from_sklearn(), path)


def load():
    """(x, y): 1797 images of 64 pixels scaled to [0, 1], and their labels."""
    path = os.environ.get(VARIABLE)
    return torch.load(path) if path else _from_sklearn()


def _from_sklearn():
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    return torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)
