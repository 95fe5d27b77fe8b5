"""The automatic chunk size on CPU: one L2 cache's worth of parameters.

Small chunks pay per-op overhead many times over; one huge chunk streams every elementwise pass
of the update through main memory. The chunk-size sweep in benchmarks/RESULTS.md ("Multi-layer
fused step") found the L2 size (2 MiB there) within a few percent of the best on both a
many-small-tensors model and a few-large-tensors one, where 256 KiB was 1.2x slower on both."""

from pathlib import Path

FALLBACK_L2 = 1 << 20
GPU_CHUNK = 1 << 28


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
    """Per device of the optimizer's first parameter. On accelerators (not measured here) each
    chunk is a kernel launch, so runs are cut only every 256 MiB."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.device.type != "cpu":
                return GPU_CHUNK
            break
    return max(256 << 10, l2_bytes())
