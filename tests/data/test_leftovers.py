"""The data side leaves nothing behind: not when the job is stopped by SIGTERM (torchrun's way of
stopping workers), whatever the program's own handler does, and not after many enable/disable
cycles, in the temporary directory or among the process's open files."""

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from data_fixtures import policy_for
from spawn import SUPPORT, clean_env, patience, run_python, write_script


def _children(pid):
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _command(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.parametrize("cache,own_handler", [("1", False), ("redis", False), ("1", True)])
def test_sigterm_leaves_nothing_in_the_temp_dir(cache, own_handler, tmp_path, child_tmpdir, installed):
    tmp = child_tmpdir
    env = clean_env(OMP_NUM_THREADS=1, FUSEDOPT_ENABLE=1, FUSEDOPT_DATA_CACHE=cache, TMPDIR=tmp,
                    XDG_CACHE_HOME=tmp_path / "home-cache", FUSEDOPT_POLICY=policy_for(tmp_path, tmp_path / "cache"))
    options = ["--wait-for-signal"] + (["--own-handler"] if own_handler else [])
    job = subprocess.Popen([sys.executable, str(SUPPORT / "data_job.py"), str(tmp_path / "out.pt"), *options],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + patience(120)
        line = ""
        while line.strip() != "ready" and time.monotonic() < deadline and job.poll() is None:
            if select.select([job.stdout], [], [], 1.0)[0]:     # a job that hangs fails in time
                line = job.stdout.readline()
        assert line.strip() == "ready", job.stderr.read() if job.poll() is not None else "no 'ready' in time"
        servers = [p for p in _children(job.pid) if "redis-server" in _command(p)]
        assert len(servers) == (cache == "redis")
        job.send_signal(signal.SIGTERM)
        out, err = job.communicate(timeout=patience(60))
    finally:
        if job.poll() is None:
            job.kill()
    if own_handler:
        assert job.returncode == 3 and "own handler ran" in out   # the program's handler decided
    else:
        assert job.returncode == -signal.SIGTERM, err
    deadline = time.monotonic() + patience(10)
    while any(_command(p) for p in servers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in servers if "redis-server" in _command(p)]   # the server died with the job
    assert sorted(os.listdir(tmp)) == []


CYCLES = """
import gc, os, sys, json
import torch
from torch.utils.data import DataLoader
import autopatch
from data_fixtures import Features

def fds():
    return sorted(os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                  if os.path.exists(f"/proc/self/fd/{fd}"))

counts = []
for cycle in range(30):
    autopatch.enable("safe", data={"cache": {"backend": "local", "path": sys.argv[1]}})   # the data side alone
    loader = DataLoader(Features(16, load_seconds=0.002), batch_size=4, num_workers=2 if cycle < 2 else 0)
    for _ in range(2):
        list(loader)
    assert autopatch.report()["data"]["cache"]["hits"] >= 16
    autopatch.disable()
    del loader
    if cycle in (2, 29):     # past the cycles with workers; their iterators' pipes close when collected
        gc.collect()
        counts.append(fds())
print(json.dumps({"after_3": counts[0], "after_30": counts[1], "tmp": sorted(os.listdir(os.environ["TMPDIR"]))}))
"""


def test_enable_disable_cycles_leave_no_files_and_no_open_handles(tmp_path, child_tmpdir, installed):
    tmp = child_tmpdir
    script = write_script(tmp_path / "cycles.py", CYCLES)
    # torch's own cache directory (created when the report reads dynamo's settings) is not the
    # data side's: it goes elsewhere
    env = clean_env(OMP_NUM_THREADS=1, TMPDIR=tmp, XDG_CACHE_HOME=tmp_path / "home-cache",
                    TORCHINDUCTOR_CACHE_DIR=tmp_path / "inductor")
    done = run_python([script, tmp_path / "cache"], env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["tmp"] == [] and sorted(os.listdir(tmp)) == []
    assert out["after_30"] == out["after_3"], (out["after_3"], out["after_30"])
