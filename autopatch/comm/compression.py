"""Gradient compression on the wire, and the error each option may add.

Buckets are multiplied by 1/world before they are encoded, so the sum across ranks is already the
average (as in torch's ``fp16_compress_hook``). Only float32 buckets are compressed; buckets of
other dtypes travel as they are.

Per element, for the average ``m`` of the world ``w`` gradients ``g_1..g_w``, with
``S = mean_i |g_i|`` and ``R`` the mean over ranks of ``max - min`` of that rank's gradient over
the quantisation row (each rank's piece of the bucket):

- ``none``: float32 sums. On 2 ranks bitwise equal to DDP (one addition per element, and the 1/2
  scaling is exact); on more ranks the summation order follows the bucket boundaries, as it does
  in DDP, so results agree with DDP within float32 rounding.
- ``fp16``: ``|r - m| <= w * 2**-11 * S + 2 * w * 2**-25``: each term and each partial sum rounds
  to a 10-bit mantissa; the second term is fp16's subnormal spacing. Halves the bytes sent. An
  average gradient above 65504 overflows to inf (use ``bf16`` for such models).
- ``bf16``: ``|r - m| <= w * 2**-8 * S``, with float32's range, so no overflow. Halves the bytes.
- ``minmax_uint8``: 8-bit codes between each row's min and max, as Bagua's ByteGrad: every rank
  sends piece ``k`` of its bucket to rank ``k``, which averages the ``w`` decoded pieces and sends
  the average back in 8 bits. ``|r - m| <= 1.002 * R / 255`` plus float32 rounding: half a code
  step for each rank's piece and for the average. Cuts the bytes by about 4x at any world size.
"""

import torch

from ..policy import check_setting

CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
HEADER_BYTES = 8     # a row's float32 min and max, stored after its codes


def checked(compression):
    """``compression`` when ``allreduce.compression`` takes it, else a ValueError naming the ones it does."""
    return check_setting("allreduce.compression", compression)


def compresses(compression, tensor):
    return compression != "none" and tensor.dtype == torch.float32


def quantize_rows_(rows):
    """float32 ``[r, c]`` -> uint8 ``[r, c + 8]``: each row's codes, then its min and max.

    Encodes in place (``rows`` is left holding the codes plus one half): no full-size temporary,
    whose fresh pages would cost more than the arithmetic on a CPU. The copy to uint8 truncates,
    so codes plus one half, all within [0, 256), round to the nearest code in that one pass
    (rounding and clamping passes of their own took most of the encoding's time).
    """
    lo, hi = rows.amin(1, keepdim=True), rows.amax(1, keepdim=True)
    inverse_step = torch.where(hi > lo, 255 / (hi - lo), torch.ones_like(hi))
    rows.sub_(lo - 0.5 / inverse_step).mul_(inverse_step)
    wire = torch.empty(rows.shape[0], rows.shape[1] + HEADER_BYTES, dtype=torch.uint8, device=rows.device)
    wire[:, :-HEADER_BYTES] = rows
    wire[:, -HEADER_BYTES:] = torch.cat([lo, hi], 1).view(torch.uint8)
    return wire


def dequantize_rows(wire, out=None):
    """The inverse of ``quantize_rows_`` to within half a code step, into ``out`` when given."""
    header = wire[:, -HEADER_BYTES:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    lo, hi = header[:, :1], header[:, 1:]
    if out is None:
        out = torch.empty(wire.shape[0], wire.shape[1] - HEADER_BYTES, device=wire.device)
    out.copy_(wire[:, :-HEADER_BYTES])
    return torch.addcmul(lo, out, (hi - lo) / 255, out=out)


def error_bound(compression, grads):
    """The documented per-element bound on ``|averaged - exact average|`` for one bucket.

    ``grads``: every rank's float32 gradient for that bucket (before scaling). For minmax the
    range is taken over the whole bucket, which bounds the range over any of its rows.
    """
    w = len(grads)
    stack = torch.stack([g.double() for g in grads])
    if compression == "none":
        return torch.zeros_like(stack[0])
    if compression == "fp16":
        return w * 2.0**-11 * stack.abs().mean(0) + 2 * w * 2.0**-25
    if compression == "bf16":
        return w * 2.0**-8 * stack.abs().mean(0)
    if compression == "minmax_uint8":
        spread = (stack.amax(1) - stack.amin(1)).mean()
        rounding = 4 * torch.finfo(torch.float32).eps * stack.abs().max()
        return torch.full_like(stack[0], (1.002 * spread / 255 + rounding).item())
    raise ValueError(f"no error bound for compression {checked(compression)!r}")
