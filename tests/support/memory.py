"""Peak tensor memory of stretches of CPU work, measured exactly.

torch's profiler records every CPU allocation and free with its size (``profile_memory=True``), so
the bytes held by tensors at any moment are the running sum of those records: the CPU analogue of
``torch.cuda.max_memory_allocated``, free of the resident-set noise of code pages, the Python heap
and glibc's allocation history. A window is bracketed by two marker allocations of sizes no
tensor of the job has, so no clock has to agree with the profiler's.
"""

import torch
from torch.profiler import ProfilerActivity, profile

MARK = 7919     # window i opens with a marker of MARK + 4 i bytes and closes with MARK + 4 i + 2: odd sizes


class TensorMemory:
    """Record allocations while open. Each ``with tm.window():`` block is one window; ``peaks()``
    gives, per window, the most bytes held by tensors at once during it (counting every tensor
    allocated since the recording began and still alive)."""

    def __enter__(self):
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        self.count = 0
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)

    def window(self):
        return _Window(self)

    def peaks(self):
        marks = {MARK + 4 * i + k: (i, k) for i in range(self.count) for k in (0, 2)}
        peaks = [0] * self.count
        live, inside = 0, None
        for e in self._prof.profiler.kineto_results.events():
            if e.name() != "[memory]" or not str(e.device_type()).endswith("CPU"):
                continue
            n = e.nbytes()
            if abs(n) in marks:
                if n > 0:
                    i, k = marks[n]
                    inside = i if k == 0 else None
                    if inside is not None:
                        peaks[i] = max(peaks[i], live)
                continue
            live += n
            if inside is not None and live > peaks[inside]:
                peaks[inside] = live
        return peaks


class _Window:
    def __init__(self, tm):
        self.tm = tm
        self.index = tm.count
        tm.count += 1

    def __enter__(self):
        torch.empty(MARK + 4 * self.index, dtype=torch.uint8)       # allocated and freed: opens

    def __exit__(self, *exc):
        torch.empty(MARK + 4 * self.index + 2, dtype=torch.uint8)   # closes
