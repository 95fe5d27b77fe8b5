"""A cache's last partial batch of writes reaches the store while the run goes on: with
``writer_buffer_size`` 20 and 102 samples, every DataLoader worker's and the main process's
left-over writes are seen by ``num_keys()`` and by another process, without waiting for exit."""

import time

import pytest
from torch.utils.data import DataLoader

from autopatch.data import CachedDataset
from data_fixtures import Features
from spawn import SUPPORT, patience, run_python

COUNT = """
import sys
from autopatch.data import LocalStore
print(LocalStore(sys.argv[1]).num_keys())
"""


def seen_elsewhere(path):
    """The number of entries another process finds in the local store at ``path``."""
    done = run_python(["-c", COUNT, path], timeout=60)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def one_epoch(tmp_path, max_age=None, **loader):
    cached = CachedDataset(Features(102, load_seconds=0), backend="local", dataset_name="d",
                           writer_buffer_size=20, path=tmp_path / "cache")
    if max_age is not None:
        cached.cache_loader.writes.max_age = max_age
    cached.loader = DataLoader(cached, batch_size=4, **loader)   # persistent workers live as long as it
    for _ in cached.loader:
        pass
    return cached


@pytest.mark.parametrize("loader", [{"num_workers": 0}, {"num_workers": 2},
                                    {"num_workers": 2, "persistent_workers": True}],
                         ids=["main process", "workers", "persistent workers"])
def test_every_sample_is_in_the_store_after_one_epoch(loader, tmp_path):
    cached = one_epoch(tmp_path, **loader)
    deadline = time.monotonic() + patience(10)   # persistent workers' last writes go within a second
    while cached.cache_loader.num_keys() < 102 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cached.cache_loader.num_keys() == 102
    assert seen_elsewhere(tmp_path / "cache") == 102


def test_a_batch_served_whole_from_the_store_sends_what_waits(tmp_path):
    cached = one_epoch(tmp_path, max_age=600, num_workers=0)   # only the all-hit read may send the last two
    assert len(cached.cache_loader.writes) == 2
    cached.__getitems__([0, 1, 2, 3])
    assert len(cached.cache_loader.writes) == 0
    assert seen_elsewhere(tmp_path / "cache") == 102


def test_a_process_that_stops_writing_sends_its_last_writes_within_a_second(tmp_path):
    cached = one_epoch(tmp_path, num_workers=0)
    deadline = time.monotonic() + patience(10)
    while len(cached.cache_loader.writes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert seen_elsewhere(tmp_path / "cache") == 102


def test_workers_forked_while_the_timer_writes_never_hang(tmp_path):
    done = run_python([SUPPORT / "fork_while_writing.py", tmp_path / "cache"], timeout=150)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "400"], done.stdout
