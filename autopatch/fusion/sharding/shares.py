"""Where a flat run is cut between the ranks that share its optimizer state.

Each rank owns one contiguous range of every sharded run: it holds the optimizer state of that
range only and steps it only. The even cut of rank r is at ``numel * r / world``. A cut inside a
chunk that lies in one parameter stays where it is (by elements): the chunk becomes two, each
still inside that one parameter, so each still reads the parameter's gradient in place. A chunk
of several parameters gathers whole parameters' gradients, so a cut inside one moves to the nearer
boundary of the parameter it falls in, splitting the chunk into two of whole parameters. Such
parameters are each smaller than a chunk, so every share stays within one chunk of even.
"""

import bisect


def cut_shares(bounds, offsets, world):
    """``(bounds, cuts)``: the chunk bounds with the cuts added, and the ``world + 1`` cut
    points, rank r owning elements ``[cuts[r], cuts[r + 1])``. ``bounds`` are a run's chunk
    bounds (first 0, last its length), ``offsets`` where each of its parameters starts."""
    numel = bounds[-1]
    ends = list(offsets[1:]) + [numel]
    cuts = [0]
    for r in range(1, world):
        x = numel * r // world
        ci = bisect.bisect_right(bounds, x) - 1
        i = bisect.bisect_right(offsets, x) - 1
        s, e = offsets[i], ends[i]
        if x == bounds[ci] or (s <= bounds[ci] and bounds[ci + 1] <= e):
            cut = x
        else:
            cut = s if x - s <= e - x else e
        cuts.append(max(cut, cuts[-1]))
    cuts.append(numel)
    return sorted(set(bounds) | set(cuts)), cuts
