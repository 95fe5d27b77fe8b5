"""How large a chunk is: the default per device, and the bound that keeps any chunk size cheap.

On CPU the default is one L2 cache's worth of parameters. Small chunks pay per-op overhead many
times over; one huge chunk streams every elementwise pass of the update through main memory. The
chunk-size sweep in benchmarks/RESULTS.md ("Multi-layer fused step") found the L2 size (2 MiB
there) within a few percent of the best on both a many-small-tensors model and a few-large-tensors
one, where 256 KiB was 1.2x slower on both.

On accelerators each chunk op is a kernel launch: a chunk of ``ACCELERATOR_CHUNK`` keeps a launch's
few microseconds small against the kernel's own time at memory bandwidth, and the bound below
still applies.

Mode backward frees each chunk's gradients as soon as its update has run, so its chunks hold at
most ``BACKWARD_WINDOW``: the gradients alive during backward are then a few MiB, not a chunk.

Whatever size is asked for, a chunk is at most ``1/MEMORY_SHARE`` of the optimizer's fused bytes
(never less than ``MEMORY_FLOOR``): gathering a chunk's gradients costs one chunk of memory for a
moment, and an optimizer written as a loop of tensor ops holds a few chunk-sized temporaries where
unpatched it held parameter-sized ones, so that bound keeps both to a few percent of the gradients
(with 1/32, AdamW's two chunk-sized temporaries put a 64 MiB model 6-9 MiB above unpatched, at the
edge of the 10% a user should ever pay; 1/64 halves it). The one copy of gradients kept, that of
parameters under ``KEEP_BELOW`` bytes (biases, norms), smallest first (``smallest_share``),
gathered into a buffer made once rather than moved (for them a new view per step would cost more
than the copy), is bounded by ``1/KEEP_SHARE`` of the fused bytes.
"""

from pathlib import Path

FALLBACK_L2 = 1 << 20
ACCELERATOR_CHUNK = 32 << 20
BACKWARD_WINDOW = 4 << 20
MEMORY_SHARE = 64
KEEP_SHARE = 32
MEMORY_FLOOR = 2 << 20
KEEP_BELOW = 16 << 10


def l2_bytes():
    try:
        for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
            if (index / "level").read_text().strip() == "2":
                text = (index / "size").read_text().strip().upper()
                mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
                return int(text.rstrip("KM")) * mult
    except (OSError, ValueError):
        pass
    return FALLBACK_L2


def default_chunk_bytes(opt):
    """Per device of the optimizer's first parameter."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.device.type != "cpu":
                return ACCELERATOR_CHUNK
            break
    return max(256 << 10, l2_bytes())


def chunk_bytes_for(opt, setting):
    """The chunk size a policy's ``fusion.chunk_bytes`` (a byte count, or ``auto``) gives ``opt``."""
    return default_chunk_bytes(opt) if setting == "auto" else int(setting)


def bounded_chunk_bytes(chunk_bytes, fused_bytes):
    """``chunk_bytes``, cut down to the memory bound for an optimizer fusing ``fused_bytes``."""
    return min(int(chunk_bytes), max(MEMORY_FLOOR, fused_bytes // MEMORY_SHARE))


def smallest_share(params, fused_bytes):
    """Ids of the parameters under KEEP_BELOW bytes, smallest first, whose bytes together stay
    within 1/KEEP_SHARE of ``fused_bytes``."""
    budget, used, out = fused_bytes // KEEP_SHARE, 0, set()
    for p in sorted(params, key=lambda p: p.numel() * p.element_size()):
        used += p.numel() * p.element_size()
        if used > budget or p.numel() * p.element_size() >= KEEP_BELOW:
            break
        out.add(id(p))
    return out
