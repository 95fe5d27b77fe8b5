"""Tensors seen as one flat buffer per (dtype, device), for collectives over whole models.

Copies go in and out in place (``Tensor.copy_``): parameters keep their storage, so flat
buffers of the fused optimizer and views held elsewhere stay valid (torch's
``vector_to_parameters`` rebinds ``.data`` instead).
"""

import torch


class FlatTensors:
    def __init__(self, tensors):
        self.groups = {}
        for t in tensors:
            self.groups.setdefault((t.dtype, t.device), []).append(t)
        self.numel = sum(t.numel() for t in tensors)
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def gather(self, dtype=None):
        """A fresh flat copy per group, in ``dtype`` when given (float32 codes, for example)."""
        with torch.no_grad():
            flats = [torch.cat([t.reshape(-1) for t in ts]) for ts in self.groups.values()]
        return flats if dtype is None else [f.to(dtype) for f in flats]

    def scatter(self, flats):
        """Copy ``flats`` (as ``gather`` made them) back into the tensors, in place."""
        self._each(flats, torch.Tensor.copy_)

    def add(self, flats):
        """Add ``flats`` (as ``gather`` made them) to the tensors, in place."""
        self._each(flats, torch.Tensor.add_)

    def _each(self, flats, op):
        with torch.no_grad():
            for ts, flat in zip(self.groups.values(), flats):
                for t, piece in zip(ts, flat.split([t.numel() for t in ts])):
                    op(t, piece.view_as(t))
