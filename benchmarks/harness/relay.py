"""Multi-rank jobs that stay up and take turns in short blocks.

Where a contender is a job of several ranks (``launch.run_ranks``), starting a job per turn puts
seconds of process start-up between two contenders' turns, and load from other work on a shared
machine changes faster than that. Here every contender's job starts once; its ranks then wait
(rank 0 on a connection to the launching side, the others in a broadcast from rank 0, both without
spinning) until the launching side gives that job a block to run, so contenders alternate within a
fraction of a second and no start-up is timed. Launching side::

    with Relay({name: env, ...}, [script, "--worker", ...], world_size=4, timeout=900) as relay:
        for r, name in turns(relay.jobs, rounds):
            got = relay.ask(name, steps)          # what the job's rank 0 answered, or None if it failed
        last = relay.finish()                     # name -> what each rank 0 answered to the end

Rank side (after ``launch.init_rank()``)::

    baton = Baton()
    while (steps := baton.next()) is not None:
        ... run the block ...
        baton.answer(figures)                     # rank 0's figures reach the launching side
    baton.answer(final)                           # the answer to finish()

A job that fails is dropped from ``jobs`` (its later turns are skipped) and its ranks' output is
in ``failures``.
"""

import os
import secrets
import threading
import time
from multiprocessing.connection import Client, Listener

from . import launch

ADDRESS, KEY, NAME = "RELAY_ADDRESS", "RELAY_KEY", "RELAY_NAME"


class Relay:
    def __init__(self, jobs, argv, world_size, *, timeout=900):
        """``jobs``: name -> environment of its ranks (beyond the launcher's)."""
        self.key = secrets.token_bytes(16)
        self.listener = Listener(("127.0.0.1", 0), authkey=self.key)
        self.timeout = timeout
        self.jobs, self.failures, self._conns, self._ranks = {}, {}, {}, {}
        host, port = self.listener.address
        self._threads = []
        for name, env in jobs.items():
            env = dict(env, **{ADDRESS: f"{host}:{port}", KEY: self.key.hex(), NAME: name})
            thread = threading.Thread(target=self._run, args=(name, argv, world_size, env), daemon=True)
            thread.start()
            self._threads.append(thread)
        self._accept(len(jobs))

    def _run(self, name, argv, world_size, env):
        self._ranks[name] = launch.run_ranks(argv, world_size, env=env, timeout=self.timeout)
        why = launch.failed(self._ranks[name])
        if why:
            self.failures[name] = why

    def _accept(self, n):
        """Wait for every job's rank 0 to call in (a job that fails first never does): a thread
        answers the calls, so a job that fails or hangs cannot keep the others waiting."""
        def answer_calls():
            try:
                while True:
                    conn = self.listener.accept()
                    name = conn.recv()
                    self._conns[name], self.jobs[name] = conn, True
            except OSError:      # the listener was closed
                pass
        threading.Thread(target=answer_calls, daemon=True).start()
        deadline = time.monotonic() + self.timeout
        while len(self.jobs) + len(self.failures) < n and time.monotonic() < deadline:
            time.sleep(0.1)

    def ask(self, name, request):
        """Give ``name`` a turn; its rank 0's answer, or None (and the job dropped) if it failed."""
        conn = self._conns[name]
        try:
            conn.send(request)
            if conn.poll(self.timeout):
                return conn.recv()
        except (EOFError, OSError):
            pass
        self.jobs.pop(name, None)
        return None

    def finish(self):
        """End every job; name -> its rank 0's last answer (None for a failed job)."""
        last = {name: self.ask(name, None) for name in list(self.jobs)}
        for thread in self._threads:
            thread.join(self.timeout)
        return last

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for conn in self._conns.values():
            conn.close()
        self.listener.close()


class Baton:
    """A rank's side: rank 0 calls the launching side in; every rank learns each request from it."""

    def __init__(self):
        import torch.distributed as dist
        self.dist = dist
        self.rank = dist.get_rank()
        self.conn = None
        if self.rank == 0:
            host, port = os.environ[ADDRESS].rsplit(":", 1)
            self.conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[KEY]))
            self.conn.send(os.environ[NAME])

    def next(self):
        """The next request (None: stop), the same on every rank."""
        box = [self.conn.recv() if self.rank == 0 else None]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def answer(self, obj):
        if self.rank == 0:
            self.conn.send(obj)
