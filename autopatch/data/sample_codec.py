"""Samples to bytes and back, bit for bit, with the same bytes every time a sample is the same.

Plain pickle gives the first but not the second: torch pickles a tensor's storage under its
memory address, so two loads of one sample pickle differently, and a view carries its whole base
storage along (a row of a TensorDataset would store the dataset). Here an ordinary CPU tensor is
stored as the bytes of the storage span it views, with its dtype, shape, strides and
requires_grad; everything else is pickled as usual. The same bytes for the same sample is what
lets the probe compare two loads and the signature tell a changed dataset from an unchanged one.
"""

import copyreg
import io
import pickle

import torch

__all__ = ["encode", "decode", "Unstorable"]


class Unstorable(TypeError):
    """A sample holds something the cache could not give back exactly."""


def encode(sample):
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=5)
    pickler.dispatch_table = _DISPATCH
    try:
        pickler.dump(sample)
    except Unstorable:
        raise
    except Exception as e:   # unpicklable members: lambdas, open files, locks...
        raise Unstorable(f"the sample cannot be pickled: {type(e).__name__}: {e}") from e
    return buf.getvalue()


def decode(data):
    return pickle.loads(data)


def _reduce_tensor(t):
    if (t.layout != torch.strided or t.device.type != "cpu" or t.is_quantized or t.is_conj()
            or t.is_neg() or t.grad_fn is not None or any(getattr(t, "names", ()))):
        raise Unstorable(f"the sample holds a tensor the cache cannot store exactly "
                         f"({t.device.type}, {t.layout}, {'non-leaf' if t.grad_fn else 'tagged'})")
    span = 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    size = t.element_size()
    window = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), t.storage_offset() * size,
                                                    (span * size,), (1,))
    return _rebuild_tensor, (bytearray(window.numpy()), str(t.dtype).removeprefix("torch."),
                             tuple(t.shape), t.stride(), t.requires_grad)


def _rebuild_tensor(data, dtype, shape, stride, requires_grad):
    flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    t = flat.view(getattr(torch, dtype)).as_strided(shape, stride)
    return t.requires_grad_(requires_grad) if requires_grad else t


_DISPATCH = {**copyreg.dispatch_table, torch.Tensor: _reduce_tensor}
