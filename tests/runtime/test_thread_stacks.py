"""Other threads' stacks, as the toggles read them: every frame of the functions asked about is
counted, wherever it lies in the stack; a stack deeper than can be read says so instead of
reporting none; the caller's own thread is left out."""

import threading
import time

from autopatch.thread_stacks import UNKNOWN, FunctionsOnStacks

RELEASE = threading.Event()


def region(depth):
    """Counted; ``depth`` frames of ``below`` run inside it."""
    below(depth)


def outer(depth):
    """Counted too, with a ``region`` inside it."""
    region(depth)


def below(depth):
    if depth:
        return below(depth - 1)
    RELEASE.wait(30)


def region_under(depth):
    """A ``region`` called ``depth`` frames down."""
    if depth:
        return region_under(depth - 1)
    region(0)


SHAPES = {"one region": (region, 3), "two regions": (outer, 3), "none": (below, 3),
          "a region past what is shown": (region, 150), "none, deeper than shown": (below, 150),
          "a region deep down, shown": (region_under, 150)}
EXPECTED = {"one region": 1, "two regions": 2, "none": 0, "a region past what is shown": UNKNOWN,
            "none, deeper than shown": UNKNOWN, "a region deep down, shown": 1}


def test_regions_are_counted_per_thread_and_a_stack_too_deep_is_unknown():
    stacks = FunctionsOnStacks()
    stacks.add(region.__code__)
    stacks.add(outer.__code__)
    threads = {name: threading.Thread(target=f, args=(d,)) for name, (f, d) in SHAPES.items()}
    RELEASE.clear()
    for t in threads.values():
        t.start()
    try:
        deadline = time.monotonic() + 10
        while True:         # until every thread waits at the bottom of its stack
            counts = stacks.count_by_thread()
            got = {name: counts.get(t.ident) for name, t in threads.items()}
            if got == EXPECTED or time.monotonic() > deadline:
                break
            time.sleep(0.01)
    finally:
        RELEASE.set()
        for t in threads.values():
            t.join()
    assert got == EXPECTED
    assert threading.get_ident() not in counts
