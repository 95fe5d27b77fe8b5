"""A redis-server started and owned by this process, configured as a cache.

Random eviction at capacity (``allkeys-random``): every epoch reads every key once, and under that
pattern LRU would evict each key just before it is needed again, while random eviction keeps
about capacity/size of the hits. No persistence (``--save ""``, no AOF), a random password, and
on Linux the server dies with the thread that started it, so a killed job leaves no server.
"""

import atexit
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import redis

__all__ = ["RedisServer", "RedisServerError"]

START_SECONDS = 10


class RedisServerError(RuntimeError):
    pass


def _free_port(host):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent():
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


class RedisServer:
    def __init__(self, capacity, bind="127.0.0.1", advertise=None, executable="redis-server"):
        """Start a server with ``capacity`` bytes of memory listening on ``bind``; its URL names
        ``advertise`` (the address other nodes reach) or the bound address."""
        path = shutil.which(executable)
        if path is None:
            raise RedisServerError(f"{executable} is not installed (Debian: apt-get install redis-server)")
        self._owner = os.getpid()
        self.password = secrets.token_hex(16)
        self.host = advertise or bind
        self.workdir = tempfile.mkdtemp(prefix="autopatch-redis-")
        for _ in range(5):   # the free port may be taken between asking and binding
            self.port = _free_port(bind)
            self.process = subprocess.Popen(
                [path, "--port", str(self.port), "--bind", bind, "--maxmemory", str(int(capacity)),
                 "--maxmemory-policy", "allkeys-random", "--save", "", "--appendonly", "no",
                 "--requirepass", self.password, "--protected-mode", "no", "--dir", self.workdir,
                 "--daemonize", "no", "--loglevel", "warning"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
            if self._wait_ready():
                break
        else:
            raise RedisServerError(f"redis-server did not start (exit code {self.process.returncode})")
        atexit.register(self.stop)

    @property
    def url(self):
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    def _wait_ready(self):
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=1)
        deadline = time.monotonic() + START_SECONDS
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    return False
                try:
                    return client.ping()
                except redis.ConnectionError:
                    time.sleep(0.02)
            self.process.kill()
            self.process.wait()
            return False
        finally:
            client.close()

    def alive(self):
        return self.process.poll() is None

    def stop(self):
        """Shut the server down without saving (also run at exit, by the process that started it)."""
        if os.getpid() != self._owner:
            return
        if self.process.poll() is None:
            self.process.terminate()   # redis-server exits cleanly on SIGTERM; nothing to save
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def kill(self):
        """Kill the server at once, as a crash would."""
        self.process.kill()
        self.process.wait()
