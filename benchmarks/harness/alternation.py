"""Contenders take turns, round after round, the first of each round rotating, so load from other
jobs on a shared machine falls on every contender alike; figures are medians over rounds, and a
ratio is the median of per-round ratios, both sides measured seconds apart."""

import statistics


def rotated(items, r):
    """``items`` in the order of round ``r``: the same cycle, starting ``r`` places on."""
    items = list(items)
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


def turns(contenders, rounds):
    """(round, contender) for ``rounds`` rounds in rotating order. ``contenders`` may be a dict,
    and entries taken out of it meanwhile (a contender that failed) lose their later turns."""
    for r in range(rounds):
        for c in rotated(contenders, r):
            if c in contenders:
                yield r, c


def median_ms(values):
    return 1e3 * statistics.median(values)


def round_ratios(mine, theirs, seconds=sum):
    """Per round: this contender's median step over the other's, measured in the same round.
    ``mine`` and ``theirs`` hold one list of step records per round; ``seconds`` reads a record."""
    return [statistics.median(seconds(s) for s in m) / statistics.median(seconds(s) for s in t)
            for m, t in zip(mine, theirs)]


def quartiles(values):
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]
