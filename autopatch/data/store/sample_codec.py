"""Samples to bytes and back, bit for bit, with the same bytes every time a sample is the same,
and without pickle: decoding builds data, never runs code.

What is stored: None, bools, ints, floats, complex numbers, strings, bytes, CPU tensors, NumPy
arrays and scalars of plain dtypes, and lists, tuples and dicts of these (their exact types:
subclasses such as namedtuples would need their class imported to come back). Anything else is
``Unstorable`` with the reason, and the zero-code cache leaves the dataset uncached.

A tensor is stored as the bytes of the storage span it views, with its dtype, shape, strides and
requires_grad (torch pickles a storage under its memory address, so two loads of one sample
would differ, and a view would carry its whole base along). Decoding checks every length against
the bytes it has before it allocates anything, so a damaged entry is ``Undecodable``, never a
crash or an allocation of what a corrupted length asks for.
"""

import re
import struct
import sys

import torch

from ...storage_extent import storage_extent

__all__ = ["encode", "decode", "Unstorable", "Undecodable", "STORED_KINDS"]

STORED_KINDS = ("tensors, NumPy arrays and scalars, numbers, strings, bytes, None, and lists, tuples "
                "and dicts of these")
MAX_DEPTH = 64
_DTYPES = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
_NUMPY_DTYPE = re.compile(r"[<>|=][?bBhHiIlLqQefdgFDGSUVmM]\d*(\[[0-9a-zA-Z]+\])?")
_U32, _U64, _I64, _F64 = struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<q"), struct.Struct("<d")


class Unstorable(TypeError):
    """A sample holds something the cache does not give back exactly."""


class Undecodable(ValueError):
    """Bytes that are not an encoded sample."""


# -- encoding ---------------------------------------------------------------------------------
def encode(sample):
    out = []
    _encode(sample, out, 0)
    return b"".join(out)


def _blob(data, out):
    out += [_U64.pack(len(data)), data]


def _encode(x, out, depth):
    if depth > MAX_DEPTH:
        raise Unstorable(f"the sample is nested more than {MAX_DEPTH} levels deep")
    t = type(x)
    if x is None:
        out.append(b"N")
    elif t is bool:
        out.append(b"T" if x else b"F")
    elif t is int:
        out.append(b"i")
        _blob(x.to_bytes((x.bit_length() + 8) // 8, "little", signed=True), out)
    elif t is float:
        out += [b"f", _F64.pack(x)]
    elif t is complex:
        out += [b"c", _F64.pack(x.real), _F64.pack(x.imag)]
    elif t is str:
        out.append(b"s")
        _blob(x.encode("utf-8", "surrogatepass"), out)
    elif t is bytes or t is bytearray:
        out.append(b"b" if t is bytes else b"B")
        _blob(bytes(x), out)
    elif t in (list, tuple):
        out += [b"l" if t is list else b"t", _U32.pack(len(x))]
        for item in x:
            _encode(item, out, depth + 1)
    elif t is dict:
        out += [b"d", _U32.pack(len(x))]
        for k, v in x.items():
            _encode(k, out, depth + 1)
            _encode(v, out, depth + 1)
    elif t is torch.Tensor:
        _encode_tensor(x, out)
    elif _is_numpy(x):
        _encode_numpy(x, out)
    else:
        raise Unstorable(f"the sample holds a {t.__module__}.{t.__qualname__}; the cache stores {STORED_KINDS}")


def _encode_tensor(t, out):
    if (t.layout != torch.strided or t.device.type != "cpu" or t.is_quantized or t.is_conj()
            or t.is_neg() or t.grad_fn is not None or any(getattr(t, "names", ()))):
        raise Unstorable(f"the sample holds a tensor the cache cannot store exactly "
                         f"({t.device.type}, {t.layout}, {'non-leaf' if t.grad_fn else 'tagged'})")
    span = storage_extent(t.shape, t.stride())
    size = t.element_size()
    window = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), t.storage_offset() * size,
                                                    (span * size,), (1,))
    name = str(t.dtype).removeprefix("torch.").encode()
    out += [b"X", bytes([len(name)]), name, bytes([t.dim(), t.requires_grad])]
    out += [_I64.pack(n) for n in t.shape] + [_I64.pack(s) for s in t.stride()]
    _blob(window.detach().numpy().tobytes(), out)


def _is_numpy(x):
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, (np.ndarray, np.generic))


def _encode_numpy(x, out):
    np = sys.modules["numpy"]
    dtype = x.dtype
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None \
            or not _NUMPY_DTYPE.fullmatch(dtype.str):
        raise Unstorable(f"the sample holds a NumPy {'array' if isinstance(x, np.ndarray) else 'scalar'} "
                         f"of dtype {dtype}, which the cache does not store")
    if type(x) is not np.ndarray and isinstance(x, np.ndarray):
        raise Unstorable(f"the sample holds a {type(x).__qualname__} (a subclass of numpy.ndarray)")
    descr = dtype.str.encode()
    if isinstance(x, np.generic):
        out += [b"g", bytes([len(descr)]), descr]
        _blob(x.tobytes(), out)
        return
    fortran = x.flags.f_contiguous and not x.flags.c_contiguous
    out += [b"A", bytes([len(descr)]), descr, bytes([x.ndim, fortran])]
    out += [_I64.pack(n) for n in x.shape]
    _blob(x.tobytes(order="F" if fortran else "C"), out)


# -- decoding ---------------------------------------------------------------------------------
class _Reader:
    def __init__(self, data):
        self.data = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
        self.at = 0

    def take(self, n):
        if n < 0 or self.at + n > len(self.data):
            raise Undecodable(f"the entry ends {self.at + n - len(self.data)} bytes early")
        view = self.data[self.at:self.at + n]
        self.at += n
        return view

    def byte(self):
        return self.take(1)[0]

    def unpack(self, fmt):
        return fmt.unpack(self.take(fmt.size))[0]

    def blob(self):
        return self.take(self.unpack(_U64))

    def count(self):
        n = self.unpack(_U32)
        if n > len(self.data) - self.at:   # every item takes at least one byte
            raise Undecodable(f"a container claims {n} items in {len(self.data) - self.at} bytes")
        return n


def decode(data):
    reader = _Reader(data)
    try:
        value = _decode(reader, 0)
    except Undecodable:
        raise
    except (ValueError, TypeError, OverflowError, RuntimeError, UnicodeError, struct.error) as e:
        raise Undecodable(f"{type(e).__name__}: {e}") from None
    if reader.at != len(reader.data):
        raise Undecodable(f"{len(reader.data) - reader.at} bytes follow the sample")
    return value


def _decode(r, depth):
    if depth > MAX_DEPTH:
        raise Undecodable("nested too deep")
    tag = r.byte()
    if tag == ord("N"):
        return None
    if tag in (ord("T"), ord("F")):
        return tag == ord("T")
    if tag == ord("i"):
        return int.from_bytes(r.blob(), "little", signed=True)
    if tag == ord("f"):
        return r.unpack(_F64)
    if tag == ord("c"):
        return complex(r.unpack(_F64), r.unpack(_F64))
    if tag == ord("s"):
        return str(r.blob(), "utf-8", "surrogatepass")
    if tag in (ord("b"), ord("B")):
        return (bytes if tag == ord("b") else bytearray)(r.blob())
    if tag in (ord("l"), ord("t")):
        items = [_decode(r, depth + 1) for _ in range(r.count())]
        return items if tag == ord("l") else tuple(items)
    if tag == ord("d"):
        out = {}
        for _ in range(r.count()):
            k = _decode(r, depth + 1)
            out[k] = _decode(r, depth + 1)
        return out
    if tag == ord("X"):
        return _decode_tensor(r)
    if tag in (ord("A"), ord("g")):
        return _decode_numpy(r, tag == ord("g"))
    raise Undecodable(f"unknown tag {tag}")


def _decode_tensor(r):
    name = bytes(r.take(r.byte())).decode("ascii")
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise Undecodable(f"unknown dtype {name!r}")
    ndim, requires_grad = r.byte(), r.byte()
    shape = [r.unpack(_I64) for _ in range(ndim)]
    stride = [r.unpack(_I64) for _ in range(ndim)]
    data = r.blob()
    if min(shape + stride, default=0) < 0:
        raise Undecodable("a negative size or stride")
    size = torch.empty(0, dtype=dtype).element_size()
    span = storage_extent(shape, stride)
    if span * size != len(data):
        raise Undecodable(f"a tensor of {span} elements of {size} bytes stored in {len(data)} bytes")
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    t = flat.view(dtype).as_strided(shape, stride)
    return t.requires_grad_(True) if requires_grad else t


def _decode_numpy(r, scalar):
    import numpy as np
    descr = bytes(r.take(r.byte())).decode("ascii")
    if not _NUMPY_DTYPE.fullmatch(descr):
        raise Undecodable(f"unknown NumPy dtype {descr!r}")
    dtype = np.dtype(descr)
    if dtype.hasobject:
        raise Undecodable("a NumPy dtype of objects")
    if scalar:
        data = r.blob()
        if len(data) != dtype.itemsize:
            raise Undecodable("a NumPy scalar of the wrong size")
        return np.frombuffer(data, dtype=dtype)[0]
    ndim, fortran = r.byte(), r.byte()
    shape = [r.unpack(_I64) for _ in range(ndim)]
    data = r.blob()
    numel = 1
    for n in shape:
        if n < 0:
            raise Undecodable("a negative size")
        numel *= n
    if numel * dtype.itemsize != len(data):
        raise Undecodable(f"an array of {numel} items of {dtype.itemsize} bytes stored in {len(data)} bytes")
    flat = np.frombuffer(bytearray(data), dtype=dtype)
    return flat.reshape(shape, order="F" if fortran else "C")
