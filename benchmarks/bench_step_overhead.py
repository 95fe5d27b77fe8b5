"""What an enabled autopatch costs every training step where it fuses nothing: its fixed cost per
step (catching the step, the controller's step boundaries, the session's step events, the step
timer and the breakdown's clocks), against the same loop unpatched.

On a model this small the cost is the whole difference: one Linear(16, 16) with SGD, batches of 8
sliced from tensors (no DataLoader), one torch thread. Contenders, each a process of its own
(autopatch's patches are global to a process), taking turns over rounds:

- ``unpatched``: autopatch never enabled;
- ``off``: ``autopatch.enable(mode="off")``, the default policy otherwise (the breakdown on);
- ``off, no breakdown``: the same with ``logging.breakdown: false``.

Quoted: per round, each contender's median step in thread CPU time (what the step's own thread
spends; other jobs' load on a shared machine weighs less on it) minus unpatched's, in
microseconds; the median over rounds and the quartiles. And, since a busy machine moves those
figures by more than a change to the runtime does, the Python and C function calls a step makes
(counted with ``sys.setprofile`` over 100 steps after the rounds), which load does not move. Run
it against another checkout of autopatch by putting that checkout first on ``PYTHONPATH``: that
is how before and after are compared.

    python benchmarks/bench_step_overhead.py            # about a minute
"""

import argparse
import multiprocessing
import statistics
import time

import torch
from torch import nn

from harness.alternation import quartiles
from harness.calls import calls_per_step
from harness.machine import load_average, summary
from harness.processes import Worker, in_turns, serve
from harness.report import markdown

CONTENDERS = ("unpatched", "off", "off, no breakdown")
CALLS_OVER = 100     # steps whose function calls are counted


class Job:
    def __init__(self, contender, args):
        torch.set_num_threads(1)
        torch.manual_seed(0)
        if contender != "unpatched":
            import autopatch
            autopatch.enable(mode="off", logging={"breakdown": contender == "off", "summary": False})
        self.model = nn.Linear(16, 16)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.x, self.y = torch.randn(4096, 16), torch.randint(0, 16, (4096,))
        self.i = 0
        self.run(args.warmup)

    def hello(self):
        return "ready"

    def step(self):
        """One whole training step; thread CPU seconds."""
        c0 = time.thread_time()
        j = (self.i * 8) % len(self.x)
        loss = nn.functional.cross_entropy(self.model(self.x[j:j + 8]), self.y[j:j + 8])
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.i += 1
        return time.thread_time() - c0

    def run(self, steps):
        return [self.step() for _ in range(steps)]

    def calls(self, steps):
        return calls_per_step(self.step, steps)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--steps", type=int, default=200, help="steps per contender per round")
    ap.add_argument("--warmup", type=int, default=100)
    args = ap.parse_args()
    load0 = load_average()
    ctx = multiprocessing.get_context("fork")
    workers = {name: Worker(ctx, serve, Job, name, args, timeout=600) for name in CONTENDERS}
    for w in workers.values():
        w.answer()
    rounds = in_turns(workers, args.rounds, "run", args.steps)
    calls = {}
    for name, w in workers.items():
        calls[name] = w.ask("calls", CALLS_OVER)
        w.close()
    base = [statistics.median(r) for r in rounds["unpatched"]]
    rows = [["unpatched", f"{1e6 * statistics.median(base):.1f}", "", "", f"{calls['unpatched']:.0f}"]]
    for name in CONTENDERS[1:]:
        mine = [statistics.median(r) for r in rounds[name]]
        added = [m - b for m, b in zip(mine, base)]
        lo, hi = quartiles(added)
        ratio = statistics.median(m / b for m, b in zip(mine, base))
        rows.append([name, f"{1e6 * statistics.median(mine):.1f}",
                     f"{1e6 * statistics.median(added):+.1f} ({1e6 * lo:+.1f} .. {1e6 * hi:+.1f})", f"{ratio:.3f}x",
                     f"{calls[name]:.0f} ({calls[name] - calls['unpatched']:+.0f})"])
    print(f"{summary()} (at start: {load0})")
    print(f"Linear(16, 16), SGD, batch 8, 1 torch thread; {args.rounds} rounds x {args.steps} steps per contender, "
          f"after {args.warmup} warm-up steps\n")
    print(markdown(["contender", "thread CPU us per step (median)", "added us per step (median of rounds, quartiles)",
                    "vs unpatched", "calls per step (added)"], rows))


if __name__ == "__main__":
    main()
