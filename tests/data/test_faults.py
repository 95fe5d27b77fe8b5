"""Faults of the cache's stores, each survived by a training job run as an unchanged program: its
batches equal the unpatched run's bit for bit, nothing is lost or raised, and the report says
what happened. Redis killed mid-epoch; the lmdb store cut short, filled with garbage (whole and
in part), read-only, on a full disk, and shared by two jobs at once.

Read-only and full mounts are made in a mount namespace of the job's own (``unshare``, root)."""

import os
import random
import shutil
import subprocess
import sys

import pytest

from data_fixtures import policy_for, run_job, same_batches
from spawn import SUPPORT, clean_env, patience


def _can_mount():
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=64k tmpfs /mnt && umount /mnt"], capture_output=True)
    return probe.returncode == 0


needs_mounts = pytest.mark.skipif(not _can_mount(), reason="needs root and unshare to mount in a namespace")


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The job unpatched, once for every test here (it draws the same batches every run)."""
    return run_job(tmp_path_factory.mktemp("plain") / "plain.pt", "--n", "40")


def cached_run(tmp_path, name, *options, cache="1", **env):
    """A cached run of 40 samples that each take 5 ms to load: the cache pays even when the
    machine is so busy that a read from Redis takes most of a millisecond (at 1 ms a sample the
    probe once found it would not pay, and nothing was cached for the fault to hit)."""
    env.setdefault("FUSEDOPT_POLICY", policy_for(tmp_path, tmp_path / "cache"))
    return run_job(tmp_path / f"{name}.pt", "--n", "40", "--load-seconds", "0.005", *options, cache=cache, **env)


def figures(run):
    return run["report"]["cache"]["datasets"][0]


def test_redis_killed_mid_epoch(tmp_path, plain):
    run = cached_run(tmp_path, "killed", "--kill-redis", cache="redis")
    assert same_batches(run, plain)
    f = figures(run)
    assert f["errors"] >= 1 and "Connection" in f["last_error"] and "degraded" in f, f
    assert f["hits"] + f["misses"] == 80


@pytest.mark.parametrize("damage", ["cut to half", "garbage", "garbage pages"])
def test_a_damaged_store_is_started_afresh(damage, tmp_path, plain):
    first = cached_run(tmp_path, "first")
    assert same_batches(first, plain)
    data = tmp_path / "cache" / "data.mdb"
    size = data.stat().st_size
    if damage == "cut to half":
        os.truncate(data, size // 2)
    elif damage == "garbage":
        data.write_bytes(random.Random(0).randbytes(size))
    else:   # the meta pages kept, others overwritten
        with open(data, "r+b") as f:
            rng = random.Random(1)
            for _ in range(20):
                f.seek(rng.randrange(8192, size))
                f.write(rng.randbytes(rng.randrange(1, 64)))
    second = cached_run(tmp_path, "second")
    assert same_batches(second, plain)
    f = figures(second)
    if damage == "cut to half":
        assert "cut to" in f["repaired"], f
    elif damage == "garbage":
        assert "not a readable lmdb file" in f["repaired"], f
    third = cached_run(tmp_path, "third")   # and the store serves again
    assert same_batches(third, plain) and figures(third)["hits"] > 0


@needs_mounts
def test_a_read_only_store(tmp_path, plain):
    cached_run(tmp_path, "fill")
    store = tmp_path / "cache"
    run = cached_run(tmp_path, "read_only", inside=f'mount --bind "{store}" "{store}" && '
                                                   f'mount -o remount,ro,bind "{store}" "{store}" && exec "$@"')
    assert same_batches(run, plain)
    reason = run["report"]["cache"]["uncached"][0]["reason"]
    assert "unavailable" in reason and "Read-only file system" in reason, reason


@needs_mounts
def test_a_full_disk(tmp_path):
    store = tmp_path / "cache"
    store.mkdir(mode=0o700)
    wide = ["--width", "2048"]   # 40 samples of 8 KiB, each 3 pages: the probe's 16 fit, the epoch's do not
    plain = run_job(tmp_path / "plain.pt", "--n", "40", *wide)
    run = cached_run(tmp_path, "full", *wide, inside=f'mount -t tmpfs -o size=256k,mode=0700 tmpfs "{store}" && exec "$@"')
    assert same_batches(run, plain)
    f = figures(run)
    assert "degraded" in f and "is full" in f["last_error"] and f["hits"] + f["misses"] == 80, f


def test_two_jobs_share_a_store_at_once(tmp_path, plain):
    env = clean_env(OMP_NUM_THREADS=1, FUSEDOPT_ENABLE=1, FUSEDOPT_DATA_CACHE=1,
                    FUSEDOPT_POLICY=policy_for(tmp_path, tmp_path / "cache"))
    jobs = [subprocess.Popen([sys.executable, str(SUPPORT / "data_job.py"), str(tmp_path / f"job{j}.pt"), "--n", "40",
                              "--epochs", "3"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for j in range(2)]
    try:
        outputs = [j.communicate(timeout=patience(180)) for j in jobs]
    finally:
        for j in jobs:
            if j.poll() is None:
                j.kill()
    assert [j.returncode for j in jobs] == [0, 0], [o[1] for o in outputs]
    import torch
    expected = {"epochs": plain["epochs"] + plain["epochs"][:1]}
    for j in range(2):
        run = torch.load(tmp_path / f"job{j}.pt", weights_only=False)
        assert same_batches(run, expected)
        f = figures(run)
        assert f["errors"] == 0 and f["hits"] + f["misses"] == 120 and f["hits"] >= 80, f
