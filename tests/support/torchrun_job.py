"""One torchrun job of ``fault_job.py`` (2 ranks, c10d rendezvous on 127.0.0.1: a restart needs a
rendezvous of its own, which the static one does not give) for the fault tests:
how it ended, how long after the fault, and what it left behind.

A contender is plain DDP (``ddp``: autopatch off) or an autopatch policy by name (a builtin, whose
algorithm is the one tested). Every process of the job carries ``FAULT_JOB_TOKEN`` in its
environment, so one still alive after torchrun returned (a redis-server, a worker) is found;
the job's temp dir is its own, so any ``autopatch-*`` left in it is found too.
"""

import os
import signal
import subprocess
import sys
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from spawn import IMPORT_PATH, SUPPORT, patience, short_temp_dir

SCRIPT = SUPPORT / "fault_job.py"
CONTENDERS = ("ddp", "gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "async",
              "qadam")
# A fault test whose every case costs a torchrun job gives plain DDP both of its two kinds and each
# algorithm one, in turn, but the variants none: bytegrad runs gradient_allreduce's code and
# low_precision_decentralized decentralized's with the bytes encoded otherwise (the same threads,
# exchanges and exits; tests/comm covers their encodings).
VARIANTS = ("bytegrad", "low_precision_decentralized")


def cases(kinds):
    """(contender, kind): plain DDP with each of the two ``kinds``, every algorithm but the
    variants with one of them, the first and the second in turn (see ``CONTENDERS``)."""
    algorithms = [c for c in CONTENDERS if c != "ddp" and c not in VARIANTS]
    return [("ddp", k) for k in kinds] + [(c, kinds[i % 2]) for i, c in enumerate(algorithms)]


@dataclass
class Job:
    returncode: int
    after_fault: float       # seconds from the fault (or the signal) to torchrun's exit
    leftovers: list          # autopatch-* names in the job's temp dir
    orphans: list            # command lines of the job's processes alive after torchrun returned
    out: Path                # FAULT_OUT: the ranks' weights and handler marks
    log: str


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(contender, out, fault="none", fault_rank=0, fault_step=10, steps=60, restarts=0, **env):
    """The job, started: (process, token, its TMPDIR, which the caller removes)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = short_temp_dir()
    token = uuid.uuid4().hex
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("FUSEDOPT_", "TORCHELASTIC_")) and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    full.update(PYTHONPATH=IMPORT_PATH, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TMPDIR=str(tmp),
                FAULT_JOB_TOKEN=token, FAULT_OUT=str(out), FAULT=fault, FAULT_RANK=str(fault_rank),
                FAULT_STEP=str(fault_step), FAULT_STEPS=str(steps))
    if contender != "ddp":
        full.update(FUSEDOPT_ENABLE="1", FUSEDOPT_POLICY=contender)
    full.update({k: str(v) for k, v in env.items()})
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", f"--max-restarts={restarts}",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", token, str(SCRIPT)]
    log = open(out / "log", "w")
    proc = subprocess.Popen(argv, env=full, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc, token, tmp


class Running:
    """A started job: ``poll()`` sends its signal once a rank wrote ``ready`` and says whether it
    ended; ``result()`` is its Job. ``timeout``: seconds on a quiet machine (see ``patience``)."""

    def __init__(self, contender, out, timeout=120, signal_to_send=None, **kw):
        self.out, self.signal = out, signal_to_send
        self.deadline = time.monotonic() + patience(timeout)
        self.limit = patience(timeout)
        self.proc, self.token, self.tmp = start(contender, out, **kw)

    def poll(self):
        if self.signal is not None and self.proc.poll() is None and (self.out / "ready").exists():
            self.proc.send_signal(self.signal)
            (self.out / "fault.time").write_text(repr(time.time()))
            self.signal = None
        if self.proc.poll() is None and time.monotonic() > self.deadline:
            self.stop()
            raise AssertionError(f"the job in {self.out} did not end within {self.limit:.0f} s:\n"
                                 + (self.out / "log").read_text()[-4000:])
        return self.proc.poll() is not None

    def result(self):
        ended = time.time()
        orphans = [cmd for _, cmd in processes_of(self.token)]
        leftovers = sorted(p.name for p in self.tmp.iterdir() if p.name.startswith("autopatch-"))
        self.stop()
        fault = self.out / "fault.time"
        return Job(self.proc.returncode, ended - float(fault.read_text()) if fault.exists() else float("nan"),
                   leftovers, orphans, self.out, (self.out / "log").read_text())

    def stop(self):
        """Kill the job, if still running, and every process of it left."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid, _ in processes_of(self.token):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)


def run(contender, out, **kw):
    """One job, waited for: its Job."""
    return run_all({None: (contender, out, kw)})[None]


def run_all(jobs, at_once=3):
    """Several jobs, ``at_once`` of them running at a time: {key: Job}. ``jobs``: {key:
    (contender, out, keywords for ``Running``)}."""
    results, waiting, running = {}, list(jobs.items()), {}
    try:
        while waiting or running:
            while waiting and len(running) < at_once:
                key, (contender, out, kw) = waiting.pop(0)
                running[key] = Running(contender, out, **kw)
            for key in [k for k, job in running.items() if job.poll()]:
                results[key] = running.pop(key).result()
            time.sleep(0.02)
    finally:
        for job in running.values():
            job.stop()
    return results


def processes_of(token):
    """(pid, command line) of this user's processes whose environment holds ``token``."""
    found = []
    needle = f"FAULT_JOB_TOKEN={token}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except OSError:
            continue
    return found
