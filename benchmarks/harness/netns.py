"""Gloo ranks on a slower network than loopback: a private network namespace whose loopback is
shaped with ``tc``, so a communication benchmark sees 10 Gbit/s, 1 Gbit/s or 100 Mbit/s (and an
added delay) on one machine. Needs root (``ip netns``, ``tc``).

    from harness.netns import run_ranks_shaped
    ranks = run_ranks_shaped([script, "--worker"], 4, rate="1gbit", delay="5ms", timeout=300)

runs the ranks exactly as ``launch.run_ranks`` does (same environment, return codes, outputs and a
results file per rank), inside a namespace made for the call and deleted afterwards, whatever
happens. ``shaped_loopback(rate, delay)`` is the namespace alone, as a context manager.

What is shaped: every rank shares the namespace's one loopback, so ``rate`` bounds the traffic of
all ranks together (a shared link, not one link per rank): a ring all_reduce of S bytes over N
ranks puts 2 (N - 1) S bytes through it. The rate is a token bucket (``tbf``); ``delay`` is added
to every packet by ``netem`` under it, so a round trip takes twice the delay. Kernels built without
netem (``CONFIG_NET_SCH_NETEM``) cannot add delay: ShapingUnavailable says so before any rank runs.
"""

import itertools
import os
import re
import signal
import subprocess
from contextlib import contextmanager

from .launch import run_ranks

LOOPBACK_MTU = 65536
_names = itertools.count()


class ShapingUnavailable(RuntimeError):
    """This machine cannot shape the namespace as asked (not root, no ``tc`` qdisc of that kind)."""


def bits_per_second(rate):
    """tc's rate units (``10gbit``, ``1gbit``, ``100mbit``, ``500kbit``) as bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r}: expected a number and kbit, mbit or gbit (tc's units)")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def _ip(*args, timeout=10):
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise ShapingUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def tbf_arguments(rate):
    """A token bucket at ``rate``: a bucket of one millisecond at that rate but never below two
    loopback packets (a packet larger than the bucket could never leave), and a queue deep enough
    that TCP on loopback is slowed, not dropped."""
    bytes_per_s = bits_per_second(rate) / 8
    burst = max(2 * LOOPBACK_MTU, int(bytes_per_s / 1000))
    limit = max(4 * burst, int(bytes_per_s / 4))          # a quarter of a second of traffic
    return ["tbf", "rate", rate, "burst", str(burst), "limit", str(limit)]


@contextmanager
def shaped_loopback(rate, delay=None, *, timeout=10):
    """A fresh network namespace, loopback up and shaped to ``rate`` (and ``delay``); yields its
    name. Processes left in it are killed and the namespace deleted on the way out."""
    name = f"shaped-{os.getpid()}-{next(_names)}"
    _ip("netns", "add", name, timeout=timeout)
    try:
        inside = ("netns", "exec", name)
        _ip(*inside, "ip", "link", "set", "lo", "up", timeout=timeout)
        _ip(*inside, "tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", *tbf_arguments(rate),
            timeout=timeout)
        if delay:
            try:
                _ip(*inside, "tc", "qdisc", "add", "dev", "lo", "parent", "1:1", "handle", "10:",
                    "netem", "delay", delay, "limit", "100000", timeout=timeout)
            except ShapingUnavailable as e:
                raise ShapingUnavailable(f"cannot add a delay of {delay}: this kernel has no netem "
                                         f"qdisc ({e})") from None
        yield name
    finally:
        _kill_inside(name, timeout)
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=timeout)


def _kill_inside(name, timeout):
    """Whatever still runs in the namespace was started in it by us: end it."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                          timeout=timeout).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def describe_shaping(name, timeout=10):
    """The namespace's loopback qdiscs as ``tc`` shows them (for a report)."""
    return _ip("netns", "exec", name, "tc", "qdisc", "show", "dev", "lo", timeout=timeout).strip()


def run_ranks_shaped(argv, world_size, rate, delay=None, **launch):
    """``launch.run_ranks`` inside a namespace of its own shaped to ``rate`` and ``delay``."""
    with shaped_loopback(rate, delay) as name:
        return run_ranks(argv, world_size, prefix=("ip", "netns", "exec", name), **launch)
