"""8-bit min-max codes of a flat float32 tensor, with its own min and max for every row.

One min/max pair for a whole model lets its largest values set the code step of every element,
so small weights' movements round to nothing; a pair per row of ``row`` elements (8 header bytes
per row, under 1 % at the default 1024) keeps the step local. The codes are ``compression.py``'s
row codes, the rows being consecutive slices of the tensor.
"""

from ..compression import HEADER_BYTES, dequantize_rows, quantize_rows_

DEFAULT_ROW = 1024


def padded(numel, row=DEFAULT_ROW):
    """Elements of the float32 scratch that ``encode`` and ``decode`` may be given."""
    return -(-numel // row) * row


def encode(flat, row=DEFAULT_ROW, scratch=None):
    """float32 ``[n]`` -> uint8 ``[ceil(n / row), row + 8]``; ``flat`` is left as it was.
    ``scratch``: float32 of ``padded(n, row)`` elements to work in (else a new one); ``flat``
    may be its first ``n``."""
    n = flat.numel()
    rows = -(-n // row)
    if scratch is None:
        scratch = flat.new_empty(rows * row)
    if scratch.data_ptr() != flat.data_ptr():
        scratch[:n] = flat
    scratch[n:] = flat[-1]      # padding that widens no row's range
    return quantize_rows_(scratch.view(rows, row))


def decode(wire, numel, out=None):
    """The float32 ``[numel]`` that ``wire`` stands for (in ``out``, of ``padded(numel)``
    elements, when given); the same bytes decode to the same bits on every rank, which keeps
    replicas of one rank's weights identical everywhere."""
    rows = None if out is None else out.view(wire.shape[0], wire.shape[1] - HEADER_BYTES)
    return dequantize_rows(wire, out=rows).view(-1)[:numel]


def wire_bytes(numel, row=DEFAULT_ROW):
    return -(-numel // row) * (row + HEADER_BYTES)
