"""Gloo ranks on a slower network than loopback, on one machine: 10 Gbit/s, 1 Gbit/s, 100 Mbit/s,
or a rate with an added one-way delay (1 Gbit/s + 5 ms), in private network namespaces made for
the run and deleted afterwards, whatever happens. Needs root (``ip netns``, ``tc``, TUN).

    from harness.netns import run_ranks_shaped
    ranks = run_ranks_shaped([script, "--worker"], 4, rate="1gbit", delay="5ms", timeout=300)

runs the ranks exactly as ``launch.run_ranks`` does (the same environment, return codes, outputs
and a results file per rank), with MASTER_ADDR and GLOO_SOCKET_IFNAME pointing at the shaped
network. ``shaped_network(world_size, rate, delay)`` is the network alone, as a context manager.
``two_nodes(rate)`` makes two machines joined by one link, on which ``torchrun`` runs a job of
two nodes with any number of processes on each.

The link is shared: every rank's packets cross one link of ``rate`` (as on one switch port), so a
ring all_reduce of S bytes over N ranks puts 2 (N - 1) S bytes through it.

- Without delay, the ranks share one namespace whose loopback the kernel shapes (``tbf``).
- With a delay, each rank has a namespace of its own reaching the others through a TUN device,
  and ``delay_line.py`` (a process of its own) carries their packets at ``rate`` and delivers
  each ``delay`` after it crossed: the kernel's netem would do the same, but kernels built
  without it (``CONFIG_NET_SCH_NETEM``) are common in containers. A round trip takes twice the
  delay. The delay line's timer resolution is about a millisecond.
"""

import itertools
import os
import re
import select
import signal
import subprocess
import sys
import threading
from contextlib import ExitStack, contextmanager
from pathlib import Path

from . import delay_line
from .launch import run_ranks

LOOPBACK_MTU = 65536
_names = itertools.count()


class ShapingUnavailable(RuntimeError):
    """This machine cannot make the network asked for (not root, no tc or TUN)."""


def bits_per_second(rate):
    """tc's rate units (``10gbit``, ``1gbit``, ``100mbit``, ``500kbit``) as bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r}: expected a number and kbit, mbit or gbit (tc's units)")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def seconds(delay):
    """tc's time units (``5ms``, ``200us``, ``1s``) as seconds."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(us|ms|s)", delay.strip().lower())
    if not m:
        raise ValueError(f"delay {delay!r}: expected a number and us, ms or s (tc's units)")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]


def _ip(*args, timeout=10):
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise ShapingUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


@contextmanager
def namespace(timeout=10):
    """A fresh network namespace with its loopback up; yields its name. Whatever still runs in it
    was started in it by us: it is killed, and the namespace deleted, on the way out."""
    name = f"shaped-{os.getpid()}-{next(_names)}"
    _ip("netns", "add", name, timeout=timeout)
    try:
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up", timeout=timeout)
        yield name
    finally:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                              timeout=timeout).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=timeout)


def tbf_arguments(rate):
    """A token bucket at ``rate``: a bucket of one millisecond at that rate but never below two
    loopback packets (a packet larger than the bucket could never leave), and a queue deep enough
    that TCP on loopback is slowed, not dropped."""
    bytes_per_s = bits_per_second(rate) / 8
    burst = max(2 * LOOPBACK_MTU, int(bytes_per_s / 1000))
    limit = max(4 * burst, int(bytes_per_s / 4))          # a quarter of a second of traffic
    return ["tbf", "rate", rate, "burst", str(burst), "limit", str(limit)]


class Network:
    """Where each rank runs: ``where`` for launch.run_ranks."""

    def __init__(self, namespaces, address, device):
        self.namespaces, self.address, self.device = namespaces, address, device

    def where(self, rank):
        ns = self.namespaces[rank % len(self.namespaces)]
        return ("ip", "netns", "exec", ns), {"MASTER_ADDR": self.address(0), "GLOO_SOCKET_IFNAME": self.device}


@contextmanager
def shaped_network(world_size, rate, delay=None, *, timeout=10):
    """Namespaces for ``world_size`` ranks joined by a link of ``rate`` (and ``delay``); yields a
    Network. Everything made for it is gone again on the way out."""
    bits_per_second(rate)
    with ExitStack() as stack:
        stack.enter_context(_sigterm_unwinds())
        if not delay:
            ns = stack.enter_context(namespace(timeout))
            _ip("netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", *tbf_arguments(rate), timeout=timeout)
            yield Network([ns], lambda rank: "127.0.0.1", "lo")
            return
        names = [stack.enter_context(namespace(timeout)) for _ in range(world_size)]
        for rank, ns in enumerate(names):
            inside = ("netns", "exec", ns, "ip")
            _ip(*inside, "tuntap", "add", "dev", delay_line.DEVICE, "mode", "tun", timeout=timeout)
            _ip(*inside, "addr", "add", f"{delay_line.address(rank)}/24", "dev", delay_line.DEVICE, timeout=timeout)
            _ip(*inside, "link", "set", delay_line.DEVICE, "mtu", str(delay_line.MTU), "up", timeout=timeout)
        stack.enter_context(_forwarding(names, bits_per_second(rate), seconds(delay), timeout))
        yield Network(names, delay_line.address, delay_line.DEVICE)


@contextmanager
def _sigterm_unwinds():
    """SIGTERM (``kill``, a timeout) raises SystemExit meanwhile, so the ``finally`` blocks that
    delete the namespaces run when a benchmark is stopped, as they do on Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def _forwarding(names, rate, delay, timeout):
    """delay_line.py running for ``names``, killed on the way out."""
    proc = subprocess.Popen([sys.executable, str(Path(delay_line.__file__)), str(rate), str(delay), *names],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready or proc.stdout.readline().strip() != "ready":
            proc.kill()
            raise ShapingUnavailable(f"the delay line did not start: {proc.stderr.read().strip()[-500:]}")
        yield
    finally:
        proc.kill()
        proc.wait()


def run_ranks_shaped(argv, world_size, rate, delay=None, **launch):
    """``launch.run_ranks`` on a network of ``rate`` (and ``delay``) made for the call."""
    with shaped_network(world_size, rate, delay) as network:
        return run_ranks(argv, world_size, where=network.where, **launch)


class Nodes:
    """Machines as a cluster has them, on one machine: a network namespace per node, joined by a
    veth link (``address(n)`` is node n's address on it, ``device(n)`` its interface)."""

    def __init__(self, names):
        self.names = names

    @staticmethod
    def address(node):
        return f"10.77.{os.getpid() % 250}.{node + 1}"

    @staticmethod
    def device(node):
        return f"apv{os.getpid() % 100000}n{node}"

    def torchrun(self, script, procs_per_node, env, timeout, args=()):
        """``torchrun --nnodes=N`` in every node's namespace at once (c10d rendezvous on node 0,
        any number of processes on each node); returns each node's (return code, output). A node
        still running at ``timeout`` seconds is killed with its workers."""
        port = 29000 + os.getpid() % 1000
        procs = []
        for node, nproc in enumerate(procs_per_node):
            command = ["ip", "netns", "exec", self.names[node], sys.executable, "-m", "torch.distributed.run",
                       f"--nnodes={len(procs_per_node)}", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
                       f"--rdzv_endpoint={self.address(0)}:{port}", f"--rdzv_id=nodes{os.getpid()}",
                       f"--rdzv_conf=is_host={int(node == 0)}", f"--local_addr={self.address(node)}",
                       "--max_restarts=0", str(script), *map(str, args)]
            procs.append(subprocess.Popen(command, env=dict(env, GLOO_SOCKET_IFNAME=self.device(node)),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        out = []
        for p in procs:
            try:
                out.append((p.communicate(timeout=timeout)[0], p.returncode))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                out.append((p.communicate()[0] + "\n[killed: timed out]", None))
        return [(code, text) for text, code in out]


@contextmanager
def two_nodes(rate=None, *, timeout=10):
    """Two namespaces joined by one veth link (shaped to ``rate`` when given, as a 1 Gbit/s link
    between two machines would be); yields Nodes. Everything made for it is gone on the way out."""
    with ExitStack() as stack:
        stack.enter_context(_sigterm_unwinds())
        names = [stack.enter_context(namespace(timeout)) for _ in range(2)]
        net = Nodes(names)
        _ip("link", "add", net.device(0), "type", "veth", "peer", "name", net.device(1), timeout=timeout)
        for node, ns in enumerate(names):
            _ip("link", "set", net.device(node), "netns", ns, timeout=timeout)
            _ip("-n", ns, "addr", "add", f"{net.address(node)}/24", "dev", net.device(node), timeout=timeout)
            _ip("-n", ns, "link", "set", net.device(node), "up", timeout=timeout)
            if rate:
                _ip("netns", "exec", ns, "tc", "qdisc", "add", "dev", net.device(node), "root",
                    *tbf_arguments(rate), timeout=timeout)
        yield net
