"""Contenders in processes of their own: global hooks of one (a mode's module pre-hook, mode auto's
watch) can never slow another, and each process's peak memory is its own.

Start every process before the parent does tensor work (a forked child inherits the parent's
threads and allocator), then let them take turns::

    ctx = multiprocessing.get_context("fork")        # or torch.multiprocessing's, "forkserver"
    workers = {name: Worker(ctx, serve, Job, name, timeout=600) for name in names}
    hello = {name: w.answer() for name, w in workers.items()}
    figures = in_turns(workers, rounds, "run", steps)  # name -> [Job.run(steps) per round]
    final = {name: w.ask("finish") for name, w in workers.items()}

``serve`` builds ``Job(*args)`` in the child, sends its ``hello()``, then answers each
``ask(method, arg)`` with ``job.method(arg)`` until ``finish``. Every answer is waited for with a
time limit; a child that fails sends its traceback, raised in the parent as WorkerError.
"""

import traceback

from .alternation import turns


class Skip(Exception):
    """This contender cannot run here (unknown policy, option torch refuses): a note, not a failure."""


class WorkerError(Exception):
    pass


def serve(conn, make, *args):
    """A worker: build ``make(*args)``, send its hello(), then run commands until 'finish'."""
    try:
        job = make(*args)
        conn.send(job.hello())
        while True:
            cmd, arg = conn.recv()
            conn.send(getattr(job, cmd)(arg))
            if cmd == "finish":
                return
    except Skip as e:
        conn.send({"skip": str(e)})
    except BaseException:
        conn.send({"error": traceback.format_exc()})


class Worker:
    """A process and its pipe; ``target(conn, *args)`` runs in it."""

    def __init__(self, ctx, target, *args, timeout):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()
        self.timeout = timeout

    def answer(self):
        if not self.conn.poll(self.timeout):
            self.proc.kill()
            raise WorkerError(f"no answer within {self.timeout} s (killed)")
        try:
            msg = self.conn.recv()
        except EOFError:
            self.proc.join(10)
            raise WorkerError(f"the process died (exit code {self.proc.exitcode})") from None
        if isinstance(msg, dict) and "error" in msg:
            raise WorkerError(msg["error"])
        return msg

    def send(self, cmd, arg=None):
        """Ask without waiting (several workers then work at once); answer() collects."""
        self.conn.send((cmd, arg))

    def ask(self, cmd, arg=None):
        self.send(cmd, arg)
        return self.answer()

    def close(self):
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def in_turns(workers, rounds, cmd, arg=None):
    """Round by round, each of ``workers`` (name -> Worker) in rotating order answers
    ``ask(cmd, arg)``; returns name -> [its answer per round]."""
    got = {name: [] for name in workers}
    for _, name in turns(workers, rounds):
        got[name].append(workers[name].ask(cmd, arg))
    return got
