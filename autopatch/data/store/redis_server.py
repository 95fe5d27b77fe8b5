"""A redis-server started and owned by this process, configured as a cache.

Random eviction at capacity (``allkeys-random``): every epoch reads every key once, and under that
pattern LRU would evict each key just before it is needed again, while random eviction keeps
about capacity/size of the hits. No persistence (``save ""``, no AOF), and on Linux the server
dies with the thread that started it, so a killed job leaves no server.

Nothing secret is in the server's command line (``/proc/PID/cmdline`` is readable by every local
user): the configuration, password included, goes in on its standard input. The commands that
could make the server write files or change its configuration (CONFIG, SAVE, MODULE, DEBUG,
replication...) are renamed away, and its working directory is the user's private one. It
listens on the address it is given only.
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
import time

import redis

from ...private_files import private_dir
from .user_key import cache_root

__all__ = ["RedisServer", "RedisServerError"]

START_SECONDS = 10
DISABLED_COMMANDS = ("CONFIG", "SAVE", "BGSAVE", "BGREWRITEAOF", "DEBUG", "MODULE", "SLAVEOF", "REPLICAOF",
                     "MIGRATE", "ACL", "SHUTDOWN", "FAILOVER", "SYNC", "PSYNC")


class RedisServerError(RuntimeError):
    pass


def _free_port(host):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent():
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def _quoted(text):
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _config(port, bind, capacity, password, workdir):
    lines = [f"port {port}", f"bind {bind}", f"maxmemory {int(capacity)}", "maxmemory-policy allkeys-random",
             'save ""', "appendonly no", f"requirepass {password}", "protected-mode no", f"dir {_quoted(workdir)}",
             "daemonize no", "loglevel warning", 'logfile ""']
    lines += [f'rename-command {c} ""' for c in DISABLED_COMMANDS]
    return ("\n".join(lines) + "\n").encode()


class RedisServer:
    def __init__(self, capacity, bind="127.0.0.1", advertise=None, executable="redis-server", password=None,
                 workdir=None):
        """Start a server with ``capacity`` bytes of memory listening on ``bind``; its URL names
        ``advertise`` (the address other nodes reach) or the bound address. ``password``: a
        random one by default; ``workdir``: a private directory (the user's cache directory by
        default; the server writes nothing there)."""
        path = shutil.which(executable)
        if path is None:
            raise RedisServerError(f"{executable} is not installed (Debian: apt-get install redis-server)")
        self._owner = os.getpid()
        self.password = password or secrets.token_hex(16)
        self.bind = bind
        self.host = advertise or bind
        workdir = private_dir(workdir or cache_root())
        for _ in range(5):   # the free port may be taken between asking and binding
            self.port = _free_port(bind)
            self.process = subprocess.Popen([path, "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
            self.process.stdin.write(_config(self.port, bind, capacity, self.password, workdir))
            self.process.stdin.close()
            if self._wait_ready():
                break
        else:
            raise RedisServerError(f"redis-server did not start (exit code {self.process.returncode})")
        atexit.register(self.stop)

    @property
    def url(self):
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    @property
    def address(self):
        """``redis://host:port/0``: the URL without the password, what other ranks are told."""
        return f"redis://{self.host}:{self.port}/0"

    def _wait_ready(self):
        client = redis.Redis(host=self.bind, port=self.port, password=self.password, socket_timeout=1)
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
        """Stop the server (SIGTERM; nothing to save). Also run at exit by the process that started it."""
        if os.getpid() != self._owner:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self):
        """Kill the server at once, as a crash would."""
        self.process.kill()
        self.process.wait()
