"""8-bit min-max codes of a flat float32 tensor, with its own min and max for every chunk.

One min/max pair for a whole model lets its largest values set the code step of every element,
so small weights' movements round to nothing; a pair per ``chunk`` elements (8 header bytes per
chunk, under 1 % at the default 1024) keeps the step local. The codes are ``compression.py``'s
row codes, the rows being consecutive chunks.
"""

from ..compression import HEADER_BYTES, dequantize_rows, quantize_rows_

DEFAULT_CHUNK = 1024


def padded(numel, chunk=DEFAULT_CHUNK):
    """Elements of the float32 scratch that ``encode`` and ``decode`` may be given."""
    return -(-numel // chunk) * chunk


def encode(flat, chunk=DEFAULT_CHUNK, scratch=None):
    """float32 ``[n]`` -> uint8 ``[ceil(n / chunk), chunk + 8]``; ``flat`` is left as it was.
    ``scratch``: float32 of ``padded(n, chunk)`` elements to work in (else a new one); ``flat``
    may be its first ``n``."""
    n = flat.numel()
    rows = -(-n // chunk)
    if scratch is None:
        scratch = flat.new_empty(rows * chunk)
    if scratch.data_ptr() != flat.data_ptr():
        scratch[:n] = flat
    scratch[n:] = flat[-1]      # padding that widens no chunk's range
    return quantize_rows_(scratch.view(rows, chunk))


def decode(wire, numel, out=None):
    """The float32 ``[numel]`` that ``wire`` stands for (in ``out``, of ``padded(numel)``
    elements, when given); the same bytes decode to the same bits on every rank, which keeps
    replicas of one rank's weights identical everywhere."""
    rows = None if out is None else out.view(wire.shape[0], wire.shape[1] - HEADER_BYTES)
    return dequantize_rows(wire, out=rows).view(-1)[:numel]


def wire_bytes(numel, chunk=DEFAULT_CHUNK):
    return -(-numel // chunk) * (chunk + HEADER_BYTES)
