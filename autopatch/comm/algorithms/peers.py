"""Who talks to whom: the shift-one pairing and the ring, as pure functions of rank and size."""


def shift_one_peer(rank, n, s):
    """Rank ``rank``'s partner in communication number ``s`` (0, 1, ...) among ``n`` ranks.

    The lower half meets the upper half: rank r < h = n/2 pairs with h + (s + r) mod h, and
    rank r >= h with (r - h - s) mod h, so the pairing is symmetric and every upper-half rank is
    met once in h communications.
    """
    check_even(n)
    h = n // 2
    return h + (s + rank) % h if rank < h else (rank - h - s) % h


def shift_one_pairs(n, s):
    """Every pair of communication ``s``, lower rank first, ordered by it."""
    return sorted({tuple(sorted((r, shift_one_peer(r, n, s)))) for r in range(n)})


def check_even(n, hierarchical=False):
    if n % 2 == 0:
        return
    if hierarchical:
        raise ValueError(
            f"peer_selection_mode 'shift_one' pairs ranks up, but with hierarchical=True each node "
            f"takes part as one rank and there are {n} node(s), an odd number. Set "
            "hierarchical=False to pair individual ranks, or use peer_selection_mode 'all'.")
    raise ValueError(f"peer_selection_mode 'shift_one' pairs ranks up and needs an even number of "
                     f"them; there are {n}. Use peer_selection_mode 'all', or an even world size.")


def ring_neighbours(rank, n):
    """``{neighbour: multiplicity}`` on a ring: left and right, one rank counted twice when n is 2."""
    left, right = (rank - 1) % n, (rank + 1) % n
    return {left: 2} if left == right else {left: 1, right: 1}
