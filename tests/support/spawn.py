"""Real subprocesses of this Python for the tests: the environment they get, and how they are run."""

import os
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from pathlib import Path

import torch


SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
ROOT = TESTS.parent
# What a test subprocess imports from: the support modules (``training``, the workers), the
# benchmark harness they take BertAdam from, and this checkout's autopatch (the installed one is
# this checkout too, unless the tests run from a copy of it).
IMPORT_PATH = os.pathsep.join([str(SUPPORT), str(ROOT / "benchmarks"), str(ROOT)])


def patience(seconds):
    """A time limit for a test's subprocesses: ``seconds`` suits a quiet machine, so it is scaled
    by how busy this one is now (its load per core, between 1 and 8 times), or by
    ``AUTOPATCH_TEST_TIMEOUT_SCALE``. A hang still fails the test; a machine shared with other
    jobs does not."""
    scale = os.environ.get("AUTOPATCH_TEST_TIMEOUT_SCALE")
    if scale:
        return seconds * float(scale)
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    return seconds * min(8.0, max(1.0, load))


def clean_env(**extra):
    """This environment without FUSEDOPT_* or launcher variables; ``training`` importable."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FUSEDOPT_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = IMPORT_PATH
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_python(args, env=None, cwd=None, timeout=180, python=sys.executable):
    """``timeout``: seconds on a quiet machine (see ``patience``)."""
    """Run this interpreter (the one with the installed package) and capture its output."""
    return subprocess.run([str(python), *map(str, args)], env=env if env is not None else clean_env(),
                          cwd=cwd, capture_output=True, text=True, timeout=patience(timeout))


def write_script(path, text):
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def short_temp_dir():
    """A new empty directory for a child's ``TMPDIR``, with a short path: sockets made in it
    (multiprocessing's resource sharer, which DataLoader workers use to send tensors) need a path
    under 108 bytes, and pytest's own temporary paths (longer still under pytest-xdist) leave too
    little of it. The caller removes it."""
    return Path(tempfile.mkdtemp(prefix="ap-"))


def site_packages():
    return Path(sysconfig.get_paths()["purelib"])


def results_of_every_rank(worker, suite, tmp_path_factory, timeout, world):
    """``spawn_ranks``, asserting that every rank exited 0 and saved its results; returns them."""
    results, outputs, codes = spawn_ranks(worker, suite, tmp_path_factory, timeout, world)
    assert codes == [0] * world and len(results) == world, "\n".join(outputs)
    return results


def run_rank(suites):
    """A rank worker's whole run (``worker SUITE RANK INIT_FILE OUT WORLD``): join the gloo group,
    run ``suites[SUITE]()``, save its results, wait for every rank, and leave without the
    interpreter's teardown (a peer's gloo threads must not outlive the group)."""
    import datetime
    import torch.distributed as dist
    suite, rank, init_file, out, world = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    torch.save(suites[suite](), out)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def spawn_two_ranks(worker, suite, tmp_path_factory, timeout):
    """Ranks 0 and 1 of ``worker``'s ``suite``: ``spawn_ranks`` over two."""
    return spawn_ranks(worker, suite, tmp_path_factory, timeout, world=2)


def spawn_ranks(worker, suite, tmp_path_factory, timeout, world):
    """Run ranks 0 to ``world`` - 1 of ``worker``'s ``suite`` on gloo over loopback
    (``worker SUITE RANK INIT_FILE OUT WORLD``); each rank saves its results to ``rank{r}.pt``.
    Returns ({rank: results} for the ranks that saved, outputs, return codes)."""
    tmp = tmp_path_factory.mktemp(suite)
    env = clean_env(OMP_NUM_THREADS=1, GLOO_SOCKET_IFNAME="lo")
    procs = [subprocess.Popen([sys.executable, str(SUPPORT / worker), suite, str(rank),
                               str(tmp / "init"), str(tmp / f"rank{rank}.pt"), str(world)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=patience(timeout))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = {r: torch.load(tmp / f"rank{r}.pt", weights_only=False)
               for r in range(world) if (tmp / f"rank{r}.pt").exists()}
    return results, outputs, [p.returncode for p in procs]
