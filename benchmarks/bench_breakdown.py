"""What the per-step breakdown (data wait, forward, backward, optimizer, communication, autopatch's
own work) costs a training step: the same enabled autopatch with it (the default) and without it
(``logging.breakdown: false``, what ``FUSEDOPT_BREAKDOWN=0`` sets).

Two workloads, each training step timed whole (batch, forward, backward, step):

- ``quick start``: ``examples/train_mlp.py``'s model and loop (48 residual blocks of width 64, 196
  tensors, AdamW and a cosine schedule, batch 32 sliced from tensors);
- ``many small``: 100 residual blocks of width 64 (400 tensors, ``harness.workloads.many_small``)
  with Adam, fed by a real DataLoader (batch 32, no workers), so the ``__next__`` seam is timed too;
- ``tiny``: one Linear(16, 16) with SGD fed by a DataLoader (batch 8), ten times the steps: the
  breakdown's work per step does not grow with the model (one module call hooked, one backward
  call, the step's events, one DataLoader batch), and on a step this short it is large enough to
  be resolved on a shared machine: its difference, in microseconds (fastest step against fastest
  step, which other jobs' load disturbs least), over the other workloads' steps is their cost where
  the noise hides it.

Both contenders run the same fusion mode (``--mode``, multi_layer by default, so that auto's
choice cannot differ between them), each in a process of its own (the breakdown's hooks are
global), taking turns over rounds. Quoted: per round, the median step of one over the other's,
in thread CPU time (one torch thread and no loader workers: all the step's work is on this thread,
and other jobs' load on a shared machine weighs less on it) and in wall time; the median over
rounds, and the quartiles.

    python benchmarks/bench_breakdown.py                 # about 5 minutes on a quiet machine
"""

import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import autopatch
from harness.alternation import quartiles
from harness.machine import load_average, summary
from harness.processes import Worker, in_turns, serve
from harness.report import markdown
from harness.workloads import many_small

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_mlp  # noqa: E402  (the quick start's own model and data)

CONTENDERS = ("breakdown", "no breakdown")
WORKLOADS = ("quick start", "many small", "tiny")


class Job:
    def __init__(self, contender, workload, args):
        torch.set_num_threads(1)
        torch.manual_seed(0)
        autopatch.enable(mode=args.mode, logging={"breakdown": contender == "breakdown", "summary": False})
        if workload == "quick start":
            self.model = train_mlp.build_model(64, 48)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
            self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=10_000)
            self.x, self.y = train_mlp.make_task(64, 4096)
            self.batches = None
        else:
            tiny = workload == "tiny"
            self.model = nn.Linear(16, 16) if tiny else many_small()[0]
            width = 16 if tiny else 64
            self.opt = (torch.optim.SGD if tiny else torch.optim.Adam)(self.model.parameters(), lr=1e-4)
            self.sched = None
            data = torch.utils.data.TensorDataset(torch.randn(4096, width), torch.randint(0, width, (4096,)))
            self.loader = torch.utils.data.DataLoader(data, batch_size=8 if tiny else 32, shuffle=True)
            self.batches = iter(self.loader)
        self.i = 0
        self.run(args.warmup)

    def hello(self):
        return "ready"

    def batch(self):
        if self.batches is None:
            j = (self.i * 32) % len(self.x)
            return self.x[j:j + 32], self.y[j:j + 32]
        try:
            return next(self.batches)
        except StopIteration:
            self.batches = iter(self.loader)
            return next(self.batches)

    def step(self):
        """One whole training step; (thread CPU seconds, wall seconds)."""
        c0, w0 = time.thread_time(), time.perf_counter()
        x, y = self.batch()
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        if self.sched is not None:
            self.sched.step()
        self.i += 1
        return time.thread_time() - c0, time.perf_counter() - w0

    def run(self, steps):
        return [self.step() for _ in range(steps)]

    def finish(self, _):
        return {"mode": autopatch.report()["optimizers"][0]["mode"]}


def measure(workload, args):
    ctx = multiprocessing.get_context("fork")
    workers = {name: Worker(ctx, serve, Job, name, workload, args, timeout=600) for name in CONTENDERS}
    for w in workers.values():
        w.answer()
    rounds = in_turns(workers, args.rounds, "run", args.steps * (10 if workload == "tiny" else 1))
    info = {name: w.ask("finish") for name, w in workers.items()}
    for w in workers.values():
        w.close()
    modes = {i["mode"] for i in info.values()}
    if modes != {args.mode}:
        sys.exit(f"{workload}: the contenders ran modes {modes}, not {args.mode}")
    on, off = rounds["breakdown"], rounds["no breakdown"]
    row = [workload, f"{1e3 * statistics.median(s[0] for r in off for s in r):.3f}"]
    for k in (0, 1):       # thread CPU time, wall time
        ratios = [statistics.median(s[k] for s in a) / statistics.median(s[k] for s in b) for a, b in zip(on, off)]
        lo, hi = quartiles(ratios)
        row.append(f"{100 * (statistics.median(ratios) - 1):+.2f}% ({100 * (lo - 1):+.2f}% .. {100 * (hi - 1):+.2f}%)")
    added = [statistics.median(s[0] for s in a) - statistics.median(s[0] for s in b) for a, b in zip(on, off)]
    fastest = min(s[0] for r in on for s in r) - min(s[0] for r in off for s in r)
    row += [f"{1e6 * statistics.median(added):+.1f}", f"{1e6 * fastest:+.1f}"]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--steps", type=int, default=15, help="steps per contender per round")
    ap.add_argument("--warmup", type=int, default=40, help="steps before the rounds (auto's watch, planning)")
    ap.add_argument("--mode", default="multi_layer")
    ap.add_argument("--workload", choices=WORKLOADS, action="append")
    args = ap.parse_args()
    load0 = load_average()
    rows = [measure(w, args) for w in args.workload or WORKLOADS]
    print(f"{summary()} (at start: {load0})")
    print(f"mode {args.mode}, 1 torch thread; {args.rounds} rounds x {args.steps} steps per contender, "
          f"after {args.warmup} warm-up steps\n")
    print(markdown(["workload", "step CPU ms without (median)", "breakdown's cost, thread CPU (median of rounds, quartiles)",
                    "breakdown's cost, wall", "added thread CPU us per step (median of rounds)",
                    "added us, fastest step against fastest"], rows))
    if "tiny" in (args.workload or WORKLOADS):
        us = float(rows[-1][-1])
        for row in rows[:-1]:
            print(f"\nthe tiny step's added {us:+.1f} us over {row[0]}'s {row[1]} ms step: "
                  f"{100 * us / (1e3 * float(row[1])):+.2f}%")


if __name__ == "__main__":
    main()
