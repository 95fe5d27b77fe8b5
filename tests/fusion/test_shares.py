"""Where a sharded flat run is cut: contiguous shares, within one chunk of even, exactly even
inside a large parameter's chunk, at a parameter boundary inside a chunk of several; a run's
chunks stay within one share each."""

import pytest
import torch

from autopatch.fusion.flat_run import FlatRun
from autopatch.fusion.sharding.shares import cut_shares


def test_a_large_parameter_is_cut_by_elements():
    bounds, cuts = cut_shares([0, 10, 20, 30, 40], [0], 3)
    assert cuts == [0, 13, 26, 40]
    assert set(cuts) <= set(bounds)


def test_a_chunk_of_several_parameters_is_cut_at_the_nearer_boundary_of_a_parameter():
    bounds, cuts = cut_shares([0, 3, 7, 13], [0, 1, 3, 5, 7, 9, 12], 2)
    assert cuts == [0, 5, 13] and bounds == [0, 3, 5, 7, 13]


def test_a_run_of_fewer_parameters_than_ranks_leaves_some_shares_empty():
    _, cuts = cut_shares([0, 3], [0, 1, 2], 4)
    assert cuts == [0, 0, 1, 2, 3]
    _, cuts = cut_shares([0, 3], [0], 4)
    assert cuts == [0, 0, 1, 2, 3]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shares_are_within_one_chunk_of_even_and_chunks_never_straddle_them(world):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (7, 300, 5, 5, 64, 1000, 3)]
    chunk = 128
    runs = [FlatRun(params, None, chunk, share=(r, world)) for r in range(world)]
    total = sum(p.numel() for p in params)
    for r, run in enumerate(runs):
        assert run.cuts == runs[0].cuts
        assert (run.lo, run.hi) == (run.cuts[r], run.cuts[r + 1])
        assert abs((run.hi - run.lo) - total / world) <= chunk
        assert all(run.lo <= s and e <= run.hi for s, e in (run.chunk_bounds[ci] for ci in run.own))
        assert sum(run.chunk_bounds[ci][1] - run.chunk_bounds[ci][0] for ci in run.own) == run.hi - run.lo
