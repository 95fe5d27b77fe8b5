"""Tensors seen as one flat buffer per (dtype, device), for collectives over whole models.

Copies go in and out in place (``Tensor.copy_``): parameters keep their storage, so flat
buffers of the fused optimizer and views held elsewhere stay valid (torch's
``vector_to_parameters`` rebinds ``.data`` instead).

With ``keep``, ``gather`` fills the same buffers every time (one more copy of the tensors held
for good): a fresh model-sized allocation each step costs more in new pages than the copy itself
on a CPU. Its result is then only valid until the next ``gather``.
"""

import torch


class FlatTensors:
    def __init__(self, tensors, keep=False):
        self.groups = {}
        for t in tensors:
            self.groups.setdefault((t.dtype, t.device), []).append(t)
        self.numel = sum(t.numel() for t in tensors)
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.kept = [] if keep else None

    def gather(self):
        """A flat copy of the tensors per group."""
        groups = self.groups.values()
        with torch.no_grad():
            if self.kept is None:
                return [torch.cat([t.reshape(-1) for t in ts]) for ts in groups]
            if not self.kept:
                self.kept = [ts[0].new_empty(sum(t.numel() for t in ts)) for ts in groups]
            return [torch.cat([t.reshape(-1) for t in ts], out=flat) for ts, flat in zip(groups, self.kept)]

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
