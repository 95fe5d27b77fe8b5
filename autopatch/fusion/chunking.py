"""The automatic chunk size: big enough to amortise per-op overhead, small enough that one
chunk's param, grad and state stay in the CPU's L2 cache while the update streams over it."""

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
    """Per device of the optimizer's first parameter: on GPUs one chunk per run is best."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.device.type != "cpu":
                return GPU_CHUNK
            break
    return max(64 << 10, l2_bytes() // 8)
