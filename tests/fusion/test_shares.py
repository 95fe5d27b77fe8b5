"""Where a sharded flat run is cut: contiguous shares, within one chunk of even, and inside a
large parameter's chunk exactly even; a run's chunks stay within one share each."""

import pytest
import torch

from autopatch.fusion.flat_run import FlatRun
from autopatch.fusion.shares import cut_shares


def test_a_large_parameter_is_cut_by_elements():
    bounds, cuts = cut_shares([0, 10, 20, 30, 40], [0], 3)
    assert cuts == [0, 13, 26, 40]
    assert set(cuts) <= set(bounds)


def test_a_chunk_of_several_parameters_is_cut_at_its_nearer_boundary():
    bounds, cuts = cut_shares([0, 3, 7, 12], [0, 1, 3, 5, 7, 9, 12], 2)
    assert cuts == [0, 7, 12] and bounds == [0, 3, 7, 12]


def test_a_run_smaller_than_the_world_leaves_some_shares_empty():
    _, cuts = cut_shares([0, 3], [0, 1, 2], 4)
    assert cuts == [0, 0, 0, 3, 3]


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
