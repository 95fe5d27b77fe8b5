"""8-bit min-max codes of a flat float32 tensor, with its own min and max for every chunk.

One min/max pair for a whole model lets its largest values set the code step of every element,
so small weights' movements round to nothing; a pair per ``chunk`` elements (8 header bytes per
chunk, under 1 % at the default 1024) keeps the step local. The codes are ``compression.py``'s
row codes, the rows being consecutive chunks.
"""

from ..compression import HEADER_BYTES, dequantize_rows, quantize_rows_

DEFAULT_CHUNK = 1024


def encode(flat, chunk=DEFAULT_CHUNK):
    """float32 ``[n]`` -> uint8 ``[ceil(n / chunk), chunk + 8]``; ``flat`` is left as it was."""
    n = flat.numel()
    rows = -(-n // chunk)
    scratch = flat.new_empty(rows * chunk)
    scratch[:n] = flat
    scratch[n:] = flat[-1]      # padding that widens no chunk's range
    return quantize_rows_(scratch.view(rows, chunk))


def decode(wire, numel):
    """The float32 ``[numel]`` that ``wire`` stands for; the same bytes decode to the same bits
    on every rank, which keeps replicas of one rank's weights identical everywhere."""
    return dequantize_rows(wire).view(-1)[:numel]


def wire_bytes(numel, chunk=DEFAULT_CHUNK):
    return -(-numel // chunk) * (chunk + HEADER_BYTES)
