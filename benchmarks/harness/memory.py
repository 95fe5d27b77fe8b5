"""A process's peak resident memory over the steps that matter, not one left over from start-up.

glibc raises its mmap threshold as large blocks are freed and then keeps later ones in the heap,
so a process's resident size depends on its allocation history; ``pin_mmap_threshold`` gives every
block of at least that size its own mapping, returned to the system when freed, so the resident
size follows the memory the tensors need.
"""

import ctypes
import gc
import resource

M_MMAP_THRESHOLD = -3


def status_kib(field):
    """A field of /proc/self/status (VmHWM, VmData...), in KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def pin_mmap_threshold(nbytes):
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, nbytes)


def reset_peak_memory():
    """Start a fresh peak: hand freed heap back to the system, then reset the kernel's high-water
    mark. Returns False where that is not possible (then the peak is the process's lifetime one)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory_bytes(reset_ok):
    if reset_ok:
        return status_kib("VmHWM") * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
