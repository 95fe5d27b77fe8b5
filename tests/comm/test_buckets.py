"""The bucket layout and a bucket group's reductions, on a real one-process gloo group: which
gradients share a bucket, the order buckets launch in, and the checksum every rank compares and
when it is checked."""

import datetime

import pytest
import torch
import torch.distributed as dist

from autopatch.comm.bucket_group import BucketGroup
from autopatch.comm.buckets import GradientLayout, layout_checksum, plan_buckets
from autopatch.comm.layout_check import LayoutCheck
from autopatch.comm.sync_settings import SyncSettings
from autopatch.comm.waiting import Waiter


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("buckets") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    yield dist.group.WORLD
    dist.destroy_process_group()


def params(*sizes):
    return [torch.nn.Parameter(torch.zeros(n)) for n in sizes]


def test_buckets_follow_the_ready_order_and_close_once_full():
    ps = params(10, 6, 300, 5, 5)           # float32: 40, 24, 1200, 20, 20 bytes
    layout = GradientLayout(ps, [4, 3, 2, 1, 0])
    assert layout.span[4] == ((torch.float32, torch.device("cpu")), 0, 5)
    buckets = plan_buckets(layout, ps, bucket_bytes=64)
    assert [b.params for b in buckets] == [[4, 3, 2], [1, 0]]
    assert [b.numel for b in buckets] == [310, 16]
    buf, views = buckets[1].new_buffer()
    assert [v.shape for v in views] == [torch.Size([6]), torch.Size([10])]
    assert views[0].data_ptr() == buf.data_ptr() and views[1].data_ptr() == buf[6:].data_ptr()


def test_dtypes_never_share_a_bucket_and_a_large_parameter_gets_its_own():
    ps = params(4, 1000, 4) + [torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    buckets = plan_buckets(GradientLayout(ps, [0, 1, 2, 3]), ps, bucket_bytes=100)
    assert [(b.params, b.dtype) for b in buckets] == [([0, 1], torch.float32), ([2], torch.float32),
                                                      ([3], torch.float64)]


def test_the_checksum_changes_with_anything_ranks_must_agree_on():
    ps = params(8, 8)
    layout = GradientLayout(ps, [1, 0])
    same = layout_checksum(ps, plan_buckets(layout, ps, 32), 2, 32, "none", False)
    assert same == layout_checksum(ps, plan_buckets(layout, ps, 32), 2, 32, "none", False)
    assert same != layout_checksum(ps, plan_buckets(layout, ps, 32), 2, 32, "fp16", False)
    assert same != layout_checksum(ps, plan_buckets(layout, ps, 64), 2, 64, "none", False)
    other = params(8, 4)
    assert same != layout_checksum(other, plan_buckets(GradientLayout(other, [1, 0]), other, 32), 2, 32, "none", False)


def test_a_bucket_group_launches_in_order_and_hands_each_bucket_over_once(group):
    ps = params(6, 6, 6)
    settings = SyncSettings(24)
    buckets = BucketGroup(ps, GradientLayout(ps, [2, 1, 0]), settings, group, 1, None)
    assert len(buckets) == 3 and buckets.bytes_per_step == 0        # one rank sends nothing
    for b, i in enumerate([2, 1, 0]):
        buckets.views(b)[0].fill_(float(i))
    assert not buckets.arrived(1)            # parameter 1 is bucket 1's, but bucket 0 is not full yet
    assert buckets.arrived(2)                # bucket 0 is full: it may launch, and 1 after it
    buckets.start_full()
    assert [b for _, _, b in buckets.inflight] == [0, 1] and buckets.next == 2
    handed = []
    waiter = Waiter(10, "test")
    buckets.drain(waiter, handed.append)
    assert handed == [0, 1] and buckets.inflight == []
    buckets.arrived(0)
    buckets.start_rest()
    buckets.drain(waiter, handed.append)
    assert handed == [0, 1, 2] and waiter.seconds >= 0
    assert [float(v[0][0]) for v in (buckets.take(0), buckets.take(1), buckets.take(2))] == [2.0, 1.0, 0.0]
    assert buckets.finished == [True, True, True]


def test_a_layout_is_checked_on_the_step_that_first_uses_it_and_never_again(group):
    """The header travels on a layout's first step only; the steps after it issue nothing of
    the check's, and a new layout (a knob applied) is checked once. (Ranks that disagree:
    tests/comm/test_allreduce.py.)"""
    ps = params(6, 6, 6)
    settings = SyncSettings(24)
    check = LayoutCheck(group, 1, 0, torch.device("cpu"))
    buckets = BucketGroup(ps, GradientLayout(ps, [2, 1, 0]), settings, group, 1, None)
    waiter = Waiter(10, "test")
    check.begin(buckets)
    assert not check.passed and check.checks == 1
    check.finish(waiter.wait)
    assert check.passed and check.agreed == buckets.checksum

    for _ in range(3):
        buckets.reset()
        check.begin(buckets)
        assert check.passed and check.checks == 1 and not check.completed()
        assert buckets.views(0)[0].untyped_storage().nbytes() == 6 * 4     # DDP's length: no tail

    compressed = BucketGroup(ps, GradientLayout(ps, [2, 1, 0]), SyncSettings(24, "fp16"), group, 1, None)
    check.begin(compressed)
    assert not check.passed and check.checks == 2
    check.finish(waiter.wait)
    assert check.passed and check.agreed == compressed.checksum



def test_a_bucket_view_keeps_its_parameters_memory_order():
    """A transposed or channels_last parameter's gradient view has the parameter's strides, as
    DDP lays its bucket views, so the optimizer reads it in the parameter's order."""
    ps = [torch.nn.Parameter(torch.zeros(3, 12).t()),
          torch.nn.Parameter(torch.zeros(8, 3, 3, 3).to(memory_format=torch.channels_last)),
          torch.nn.Parameter(torch.zeros(4, 5))]
    buckets = plan_buckets(GradientLayout(ps, [0, 1, 2]), ps, bucket_bytes=2**20)
    _, views = buckets[0].new_buffer()
    assert [v.stride() for v in views] == [p.stride() for p in ps]
    assert sum(v.numel() for v in views) == buckets[0].numel
