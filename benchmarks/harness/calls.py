"""Function calls per step: a measure of the work autopatch adds that a busy machine does not move.

Wall and CPU clocks on a shared machine vary by more than a few microseconds of Python a step;
the number of Python and C function calls a step makes (``sys.setprofile``) is the same in every
run of the same code, so it shows what a change to the per-step path removed, or what one
configuration keeps running that another does not.
"""

import sys


def calls_per_step(step, steps):
    """Run ``step()`` ``steps`` times; the function calls (Python and C) each made, on average."""
    n = [0]

    def count(frame, event, arg):
        if event in ("call", "c_call"):
            n[0] += 1
    sys.setprofile(count)
    try:
        for _ in range(steps):
            step()
    finally:
        sys.setprofile(None)
    return n[0] / steps
