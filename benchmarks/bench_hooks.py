"""CPU time that backward fusion's gradient hooks add to a backward pass, per parameter.

Backward fusion hooks every fused parameter's gradient (``register_post_accumulate_grad_hook``)
and counts chunks down. On an accelerator the backward pass is mostly the host launching kernels,
so the Python run per hook adds to every step of a launch-bound job. This measures it on the CPU,
where the same Python runs: a model of many small parameters whose backward is cheap, and the
thread CPU time of ``loss.backward()`` for

- ``unpatched``: no hook;
- ``empty hook``: a Python post-accumulate-grad hook that does nothing (the floor: what torch
  itself charges for calling any Python hook);
- ``backward``: autopatch mode backward (the hooks, plus updating its few chunks with SGD; the
  update is timed separately through the report and is a small part).

Each contender is a process of its own (autopatch's hooks are global to a process), taking turns
over rounds; per round the difference to unpatched is divided by the number of parameters, and the
medians over rounds are quoted. Run it against another checkout of autopatch by putting that
checkout first on ``PYTHONPATH``: that is how a before/after comparison is made.

    python benchmarks/bench_hooks.py                 # about 30 s
"""

import argparse
import multiprocessing
import statistics
import sys
import time

import torch
from torch import nn

import autopatch
from harness.machine import load_average, summary
from harness.processes import Worker, in_turns, serve
from harness.report import markdown

CONTENDERS = ("unpatched", "empty hook", "backward")


class Job:
    """One contender: its parameters, hooks and optimizer, warmed up; backward passes on request."""

    def __init__(self, contender, args):
        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.params = nn.ParameterList(nn.Parameter(torch.randn(args.size)) for _ in range(args.params))
        self.x = torch.randn(args.size)
        self.patched = contender == "backward"
        if self.patched:
            autopatch.enable(mode="backward", fusion={"observe_steps": 1})
        elif contender == "empty hook":
            for p in self.params:
                p.register_post_accumulate_grad_hook(lambda p: None)
        self.opt = torch.optim.SGD(self.params, lr=1e-3)
        self.run(args.warmup)

    def hello(self):
        return "ready"

    def step(self):
        """One training step; returns the thread CPU time of its backward pass."""
        self.opt.zero_grad()
        loss = sum((p * self.x).sum() for p in self.params)
        t0 = time.thread_time()
        loss.backward()
        took = time.thread_time() - t0
        self.opt.step()
        return took

    def run(self, steps):
        return [self.step() for _ in range(steps)]

    def finish(self, _):
        rep = autopatch.report()["optimizers"] if self.patched else []
        return {"mode": rep[0]["mode"] if rep else None,
                "in_backward": rep[0].get("fusion", {}).get("chunk_updates_in_backward") if rep else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=1000, help="number of parameters (default 1000)")
    ap.add_argument("--size", type=int, default=64, help="elements per parameter (default 64)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=5, help="backward passes per contender per round")
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()

    ctx = multiprocessing.get_context("fork")
    workers = {name: Worker(ctx, serve, Job, name, args, timeout=600) for name in CONTENDERS}
    for w in workers.values():
        w.answer()
    load0 = load_average()
    per_round = {name: [statistics.median(times) for times in rounds]
                 for name, rounds in in_turns(workers, args.rounds, "run", args.steps).items()}
    info = {}
    for name, w in workers.items():
        info[name] = w.ask("finish")
        w.close()
    if info["backward"]["mode"] != "backward":
        sys.exit(f"autopatch ran mode {info['backward']['mode']}, not backward")

    base = per_round["unpatched"]
    rows = []
    for name in CONTENDERS:
        med = statistics.median(per_round[name])
        extra = [(a - b) / args.params * 1e6 for a, b in zip(per_round[name], base)]
        rows.append([name, f"{med * 1e3:.2f}", "" if name == "unpatched" else f"{statistics.median(extra):.2f}"])
    print(f"{summary()} (at start: {load0})")
    print(f"{args.params} parameters of {args.size} elements, SGD, 1 thread; {args.rounds} rounds x "
          f"{args.steps} backward passes; chunk updates inside backward per step: "
          f"{info['backward']['in_backward'] / ((args.rounds * args.steps + args.warmup) or 1):.1f}\n")
    print(markdown(["contender", "backward CPU ms (median)", "added CPU us per parameter (median)"], rows))


if __name__ == "__main__":
    main()
