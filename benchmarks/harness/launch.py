"""Run N processes as the ranks of one torch.distributed job over gloo on this machine's loopback.

The launching side::

    ranks = run_ranks([script, "--worker", ...], world_size=4, timeout=300)
    ranks = run_ranks(["-m", "package.module", ...], world_size=2)
    failed(ranks)        # None when every rank exited 0, else what each failed rank said
    ranks[0].results     # what rank 0 passed to save_results(), or None

Each rank is ``python ARGV...`` (a script or ``-m module``, with its arguments) with ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``,
``GLOO_SOCKET_IFNAME=lo``, ``OMP_NUM_THREADS=1`` and ``RANK_RESULTS`` (a JSON file of its own)
in its environment, and without autopatch's ``FUSEDOPT_*`` variables unless ``env`` sets them.
The rank side::

    init_rank()                      # init_process_group("gloo") from that environment
    ...
    save_results({"seconds": ...})   # anything JSON can hold

Every rank runs in a process group of its own; once one rank fails the others are killed (they
would wait for it in their next collective), and ranks still running at ``timeout`` (seconds, for
all of them together) are killed with their children, so a hung collective never hangs the caller.
``where(rank)`` may place each rank elsewhere: it returns a command to run it under and
environment variables to set (``netns.run_ranks_shaped`` runs ranks under ``ip netns exec``).
"""

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

RESULTS_VARIABLE = "RANK_RESULTS"


@dataclass
class RankResult:
    rank: int
    returncode: int          # negative: killed by that signal (after a peer failed, or timed out)
    timed_out: bool
    stdout: str
    stderr: str
    results: object          # what the rank saved with save_results(), or None


def child_env(**extra):
    """This environment without autopatch's ``FUSEDOPT_*`` variables (each contender names its own
    policy) or a launcher's rank variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FUSEDOPT_") and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(argv, world_size, *, env=None, timeout=600, where=None, port=None):
    """Start ``world_size`` ranks of ``python *argv``, wait for them (``timeout`` seconds in all),
    and return one RankResult per rank, in rank order."""
    tmp = Path(tempfile.mkdtemp(prefix="ranks_"))
    base = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port or free_port(), WORLD_SIZE=world_size,
                     GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS=1)
    base.update({k: str(v) for k, v in (env or {}).items()})
    procs = []
    try:
        for rank in range(world_size):
            prefix, placed = where(rank) if where else ((), {})
            rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank),
                            **{RESULTS_VARIABLE: str(tmp / f"rank{rank}.json")}, **placed)
            with open(tmp / f"rank{rank}.out", "w") as out, open(tmp / f"rank{rank}.err", "w") as err:
                procs.append(subprocess.Popen([*prefix, sys.executable, *map(str, argv)], env=rank_env,
                                              stdout=out, stderr=err, start_new_session=True))
        timed_out = _wait(procs, time.monotonic() + timeout)
        return [RankResult(rank, p.returncode, rank in timed_out, _read(tmp / f"rank{rank}.out"),
                           _read(tmp / f"rank{rank}.err"), _load(tmp / f"rank{rank}.json"))
                for rank, p in enumerate(procs)]
    finally:
        for p in procs:
            _kill(p)
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()


def _wait(procs, deadline):
    """Wait for every process until ``deadline``, killing the rest as soon as one fails (its peers
    would wait for it in their next collective until the timeout). Returns the ranks killed late."""
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if None not in codes:
            return set()
        if any(c for c in codes if c is not None):
            for p in procs:
                _kill(p)
            return set()
        time.sleep(0.05)
    late = {rank for rank, p in enumerate(procs) if p.poll() is None}
    for p in procs:
        _kill(p)
    return late


def _kill(p):
    """The rank and whatever it started (its own process group)."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def _read(path):
    return path.read_text(errors="replace") if path.exists() else ""


def _load(path):
    return json.loads(path.read_text()) if path.exists() else None


def failed(ranks):
    """None when every rank exited 0; else, per failed rank, how it ended and its last output."""
    bad = [r for r in ranks if r.returncode != 0]
    if not bad:
        return None
    def ended(r):
        if r.timed_out:
            return "timed out, killed"
        return "killed after another rank failed" if r.returncode == -signal.SIGKILL else f"exit code {r.returncode}"
    return "\n".join(f"rank {r.rank}: {ended(r)}\n" + "\n".join((r.stderr or r.stdout).strip().splitlines()[-30:])
                     for r in bad)


# -- the rank's side ------------------------------------------------------------------------------
def init_rank(timeout=300):
    """Join the job: gloo, rank and world size from the environment run_ranks() set. Returns the rank."""
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank()


def save_results(obj):
    """Hand ``obj`` (JSON) to the launching process as this rank's results."""
    Path(os.environ[RESULTS_VARIABLE]).write_text(json.dumps(obj))
