"""Cost of a short-lived optimizer under autopatch's default policy: built, stepped 1-3 times, dropped.

Scripts build optimizers that live a few steps only: a learning-rate finder, a warm-up phase, a
fine-tuning loop that builds one per task, unit tests, checkpoint round trips. Such an optimizer
never reaches the steps where autopatch pays off; what it costs is adoption, the probe, the watch of
the first steps, and whatever of that outlives it. The target is that it costs under 1.5x the
unpatched lifecycle.

Contenders: ``unpatched`` and ``autopatch`` (``autopatch.enable()``, the default policy), in one
process, taking turns round after round with the first rotating (harness.alternation). A turn of
the ``autopatch`` contender enables autopatch, runs ``--per-turn`` lifecycles each timed alone, and
disables it again; enabling and disabling are not timed. Each lifecycle trains a fresh copy of the
model (copied before the clock starts) and its optimizer:

- ``1 step``: build, one training step (zero_grad, forward, backward, step), drop;
- ``3 steps``: the same with three steps (the default policy watches the first 3);
- ``state_dict round trip``: build, one step, ``state_dict()``, a second optimizer over the same
  parameters ``load_state_dict()``s it and takes one step, drop both;
- ``tensor lr``: built with ``lr=torch.tensor(...)``, two steps, drop;
- ``deepcopy``: build, one step, ``copy.deepcopy(optimizer)``, one step of the copy, drop both.

Quoted per cell: the median lifecycle of each contender over every timed lifecycle, the median of
the per-round ratios (autopatch / unpatched, each round's medians measured seconds apart) with its
quartiles, and the same ratio for the last lifecycle of each turn alone: the lifecycles of a turn
run one after another in one enabled autopatch, as a script's would, so whatever an earlier one
left behind is paid there. The first round is a warm-up (probe caches, imports) and is not
counted. Every lifecycle's final weights are compared between the contenders (bit for bit): a
cost is only quoted for a computation that stayed the same.

    python benchmarks/bench_short_lived.py            # about 4 minutes on 2 cores
    python benchmarks/bench_short_lived.py --quick    # smoke run, well under a minute
"""

import argparse
import copy
import statistics
import sys
import time
import warnings

import torch
from torch import nn

import autopatch
from harness.alternation import quartiles, turns
from harness.machine import closing, load_average, summary
from harness.report import markdown
from harness.workloads import Block, square_loss, stack

TARGET = 1.5

OPTIMIZERS = {
    "SGD(momentum=0.9)": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9)),
    "AdamW": (torch.optim.AdamW, dict(lr=1e-3)),
}


def small():
    return stack(64, 8), torch.randn(16, 64)


def wide():
    return stack(512, 4), torch.randn(16, 512)


def deep():
    return nn.Sequential(*[Block(64) for _ in range(48)]), torch.randn(16, 64)


MODELS = {"8 x Linear(64, 64), 16 tensors": small, "4 x Linear(512, 512), 8 tensors": wide,
          "48 residual blocks of width 64, 192 tensors": deep}


def train_step(model, opt, x):
    opt.zero_grad()
    square_loss(model(x), None).backward()
    opt.step()


def steps(n, **build):
    """Build, ``n`` training steps, drop."""
    def lifecycle(make, model, x):
        opt = make(model.parameters(), **build)
        for _ in range(n):
            train_step(model, opt, x)
        del opt
    return lifecycle


def state_dict_round_trip(make, model, x):
    opt = make(model.parameters())
    train_step(model, opt, x)
    saved = opt.state_dict()
    again = make(model.parameters())
    again.load_state_dict(saved)
    train_step(model, again, x)
    del opt, again, saved


def deep_copy(make, model, x):
    opt = make(model.parameters())
    train_step(model, opt, x)
    twin = copy.deepcopy(opt)
    twin.step()          # the copy holds copies of the parameters and of their gradients
    del opt, twin


LIFECYCLES = {"1 step": steps(1), "3 steps": steps(3), "state_dict round trip": state_dict_round_trip,
              "tensor lr": steps(2, tensor_lr=True), "deepcopy": deep_copy}


def maker(cls, kwargs):
    def make(params, tensor_lr=False):
        kw = dict(kwargs)
        if tensor_lr:
            kw["lr"] = torch.tensor(kw["lr"])
        return cls(params, **kw)
    return make


class Cell:
    """One optimizer x model x lifecycle: per contender, per round, each lifecycle's seconds."""

    def __init__(self, opt_name, model_name, life_name):
        self.opt_name, self.model_name, self.life_name = opt_name, model_name, life_name
        cls, kwargs = OPTIMIZERS[opt_name]
        self.make = maker(cls, kwargs)
        torch.manual_seed(0)
        self.base, self.x = MODELS[model_name]()
        self.life = LIFECYCLES[life_name]
        self.times = {"unpatched": [], "autopatch": []}     # per round: [seconds]
        self.final = {}                                      # contender -> weights after its first lifecycle
        self.modes = set()

    def turn(self, contender, per_turn, record):
        models = [copy.deepcopy(self.base) for _ in range(per_turn)]
        if contender == "autopatch":
            autopatch.enable()
        try:
            got = []
            for model in models:
                t0 = time.perf_counter()
                self.life(self.make, model, self.x)
                got.append(time.perf_counter() - t0)
            if contender == "autopatch":
                self.modes.update(f"{o['mode']} ({o['reason'].split(':')[0]})" for o in autopatch.report()["optimizers"])
        finally:
            autopatch.disable()
        if contender not in self.final:
            self.final[contender] = [p.detach().clone() for p in models[0].parameters()]
        if record:
            self.times[contender].append(got)

    def same_weights(self):
        a, b = self.final["unpatched"], self.final["autopatch"]
        return all(torch.equal(x, y) for x, y in zip(a, b))

    def row(self):
        un = [t for r in self.times["unpatched"] for t in r]
        ap = [t for r in self.times["autopatch"] for t in r]
        last = statistics.median(r[-1] for r in self.times["autopatch"]) / statistics.median(
            r[-1] for r in self.times["unpatched"])
        ratios = [statistics.median(a) / statistics.median(u)
                  for a, u in zip(self.times["autopatch"], self.times["unpatched"])]
        ratio = statistics.median(ratios)
        q1, q3 = quartiles(ratios)
        return ratio, [self.opt_name, self.model_name, self.life_name, f"{1e3 * statistics.median(un):.2f}",
                       f"{1e3 * statistics.median(ap):.2f}", f"**{ratio:.2f}x**" if ratio >= TARGET else f"{ratio:.2f}x",
                       f"{q1:.2f}-{q3:.2f}", f"{last:.2f}x", "met" if ratio < TARGET else "not met",
                       "yes" if self.same_weights() else "NO"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, help="timed rounds (default 7, quick 3), after one warm-up round")
    ap.add_argument("--per-turn", type=int, default=5, help="lifecycles per contender per round (default 5)")
    ap.add_argument("--quick", action="store_true", help="few rounds, one optimizer, the small model")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    opt_names = list(OPTIMIZERS)[:1] if args.quick else list(OPTIMIZERS)
    model_names = list(MODELS)[:1] if args.quick else list(MODELS)

    started = time.perf_counter()
    print(f"# bench_short_lived: {summary()}")
    print(f"{rounds} rounds (+1 warm-up) x {args.per_turn} lifecycles per contender per round, contenders "
          f"alternating; load average at start {load_average('/', 1)}\n")
    cells = [Cell(o, m, life) for o in opt_names for m in model_names for life in LIFECYCLES]
    for cell in cells:
        contenders = ["unpatched", "autopatch"]
        for r, contender in turns(contenders, rounds + 1):
            cell.turn(contender, args.per_turn, record=r > 0)
    rows, worst, missed, differ = [], 0.0, 0, 0
    for cell in cells:
        ratio, row = cell.row()
        rows.append(row)
        worst = max(worst, ratio)
        missed += ratio >= TARGET
        differ += not cell.same_weights()
    print(markdown(["optimizer", "model", "lifecycle", "unpatched ms", "autopatch ms", "ratio", "ratio IQR",
                    f"ratio, lifecycle {args.per_turn} of a turn", f"target < {TARGET}x", "same weights"], rows))
    print(f"\n- ratio: median over rounds of (autopatch median / unpatched median) in the same round; "
          f"ms: median lifecycle over all timed ones; lifecycle {args.per_turn} of a turn: the last of the "
          f"lifecycles run one after the other with autopatch enabled (what earlier ones left behind is "
          f"paid there). Target met in {len(cells) - missed} of {len(cells)} cells; worst {worst:.2f}x.")
    modes = sorted({m for c in cells for m in c.modes})
    print(f"- what autopatch reported for these optimizers: {'; '.join(modes)}")
    if differ:
        print(f"- {differ} cell(s) ended with weights that differ from unpatched")
    print(f"\n{closing(started).capitalize()}.")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
