"""How much of its storage a strided tensor spans: what fusion checks before it reads a
parameter's memory, and what the data cache copies of a sample's tensor (and expects back)."""


def storage_extent(shape, stride):
    """Elements from the first to one past the last that a tensor of ``shape`` and ``stride``
    addresses in its storage; 0 for a tensor with no elements."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride))
