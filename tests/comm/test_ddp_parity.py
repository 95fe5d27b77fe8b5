"""The default policy gives unpatched DDP's results, bit for bit, at 2, 3, 4 and 8 gloo ranks.

Over more than two ranks gloo's ring sums a bucket's elements in an order that follows the
bucket's length, so only DDP's own buckets give DDP's bits: the default leaves DDP's reducer in
charge. Every scenario of a user's DDP script (``ddp_parity_worker.py``: DDP's default and a
user's ``bucket_cap_mb`` over more than DDP's 1 MiB first bucket, with its buckets rebuilt after
the first iteration, ``find_unused_parameters`` with a branch unused on some steps,
``static_graph``, ``gradient_as_bucket_view``, ``no_sync()`` accumulation, ``join()`` with uneven
inputs, a frozen parameter, mixed dtypes, two DDP models, DDP over a process subgroup) runs
unpatched and under mode auto, multi_layer and backward, on every rank.
"""

import pytest

from spawn import results_of_every_rank

WORLDS = (2, 3, 4, 8)
SCENARIOS = ("ddp_default", "bucket_cap_mb", "find_unused_parameters", "static_graph", "gradient_as_bucket_view",
             "no_sync_accumulation", "join_uneven_inputs", "frozen_parameter", "mixed_dtypes", "two_models",
             "process_subgroup")
MODES = ("auto", "multi_layer", "backward")


@pytest.fixture(scope="module", params=WORLDS, ids=[f"{w}ranks" for w in WORLDS])
def parity(request, tmp_path_factory):
    world = request.param
    return world, results_of_every_rank("ddp_parity_worker.py", "parity", tmp_path_factory, 300 + 60 * world, world)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_default_policy_equals_ddp_bitwise(parity, scenario, mode):
    world, results = parity
    for rank, res in results.items():
        got = res[scenario, mode]
        assert got["differs"] is None, (world, rank, got)
        assert got["allreduce"]["active"] is False, got["allreduce"]     # DDP's reducer averaged


def test_backward_is_refused_with_the_reason_where_ddp_keeps_the_sync(parity):
    """Named or measured, backward fusion would update from the local gradient: the optimizer
    runs multi_layer (or stays as auto decides) and says why."""
    world, results = parity
    got = results[0]["ddp_default", "backward"]
    assert got["modes"] == ["multi_layer"], got
    assert "not all of them by autopatch's allreduce" in got["reasons"][0], got
    assert "allreduce.enabled: auto keeps DDP's own reducer" in got["allreduce"]["reason"], got
