"""Which parameters may move into a flat buffer, decided from metadata alone.

Planning moves a parameter's ``.data`` into autopatch's own buffer, so it must only see tensors
whose memory nobody else manages. A DTensor (FSDP2, tensor parallel) or another wrapper subclass
has no storage of its own to read; FSDP1 re-points its ``FlatParameter`` and the
``use_orig_params`` views into it at every forward, so a moved one would be silently switched
back; and reading a storage that was freed or shrunk crashes the process instead of raising.
Every check here reads only type, flags and sizes, never the values, so it is safe on all of them.

A parameter in any memory order (transposed, permuted, channels_last) may move: it covers one
dense range of its storage, which its flat run holds in the same order, so it keeps its strides
(and every kernel reading it the path it takes unpatched). A view with gaps or overlaps (a
strided slice, an expanded tensor) has no such range and is stepped per tensor.
"""

import torch

from ..storage_extent import storage_extent
from ..torch_internals import fsdp1_flat, is_dtensor


def unfusable_param(p):
    """Why ``p`` can never live in a flat run, or None."""
    if p.numel() == 0:
        return "empty parameter"
    if not p.requires_grad:
        return "frozen (requires_grad=False)"
    if p.layout != torch.strided or not p.dtype.is_floating_point:
        return "sparse or non-floating parameter"
    why = foreign_memory(p)
    if why is None and not is_dense(p):
        return NOT_DENSE
    return why


NOT_DENSE = "not dense in memory (a view with gaps or overlaps)"


def is_dense(t):
    """True when ``t`` covers exactly ``numel`` consecutive elements of its storage, its dims in
    any order: each stride, smallest first, is the product of the sizes of the dims before it."""
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def foreign_memory(p):
    """Why ``p``'s memory is not autopatch's to read or move, or None."""
    if p.layout != torch.strided:
        return "sparse layout: no single storage"
    if is_dtensor(p):
        return "DTensor (FSDP2 or tensor parallel): its storage belongs to its local shard"
    if type(p) not in (torch.nn.Parameter, torch.Tensor):
        return f"tensor subclass {type(p).__name__}"
    fsdp = fsdp1_flat(p)
    if fsdp:
        return fsdp
    if p.is_meta:
        return "meta tensor (no data yet)"
    try:
        nbytes = p.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError) as e:   # storage of an unusual tensor type
        return f"storage cannot be read ({type(e).__name__})"
    if nbytes < (p.storage_offset() + storage_extent(p.shape, p.stride())) * p.element_size():
        return "storage is freed or smaller than the parameter (resized)"
    return None


def holds_dtensors(opt):
    """True when any parameter of ``opt`` is a DTensor (FSDP2, tensor parallel)."""
    return any(is_dtensor(p) for g in opt.param_groups for p in g["params"])
