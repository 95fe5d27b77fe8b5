"""Samples autopatch looks at itself (the probe, the signature, complexity scores) are loaded from
a shallow copy of the dataset.

Many datasets set up state lazily on their first ``__getitem__`` (an HDF5 or lmdb file, a
database connection) precisely so that each DataLoader worker opens its own. Loaded from the
original in the main process, that state would be created there and inherited by every forked
worker, which libraries that are not fork-safe do not survive. On a shallow copy it stays on the
copy. A dataset that cannot be copied is used as it is.
"""

import copy

__all__ = ["side_copy"]


def side_copy(dataset):
    try:
        return copy.copy(dataset)
    except Exception:
        return dataset
