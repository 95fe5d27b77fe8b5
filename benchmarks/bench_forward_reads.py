"""Cost of mode forward's ``Module.__getattr__`` patch on a forward pass (autopatch/forward_reads.py).

While an optimizer is in mode forward, every submodule and parameter attribute read
(``self.fc``, ``self.weight``) goes through autopatch's ``__getattr__``, which applies the pending
update of a parameter read outside its own module's forward. This measures what that costs where
it is paid: forwards between two steps, nothing pending.

How: each model trains two steps under autopatch, the second in mode forward, then rounds alternate torch's own ``Module.__getattr__`` and autopatch's (the
order flips each round); each round times ``--per-round`` forwards of one batch and keeps their
median. Everything else (autopatch's forward pre-hook included) is the same on both sides, so the
difference is the patch alone. Quoted: medians over rounds, the median of per-round differences,
and that difference per attribute read (reads per forward counted once); then one attribute read
of the model's first layer timed alone (``timeit``, wall clock, best of 15 repeats per side). One torch thread, timed
in the thread's CPU time (``time.thread_time``), so time spent waiting for a core on a shared
machine is left out.

    python benchmarks/bench_forward_reads.py [--rounds 30] [--per-round 20]
"""

import argparse
import statistics
import time
import timeit

import torch
from torch import nn

import autopatch
from harness.alternation import turns
from harness.machine import summary
from harness.report import markdown
from harness.workloads import encoder, stack


def mlp():
    torch.manual_seed(0)
    return stack(64, 48, act=nn.Tanh), torch.randn(8, 64)


def transformer():
    torch.manual_seed(0)
    return encoder(64, 4, 128, dropout=0.1), torch.randn(8, 16, 64)


def conv():
    torch.manual_seed(0)
    blocks = []
    for _ in range(8):
        blocks += [nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()]
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), *blocks), torch.randn(4, 3, 16, 16)


MODELS = {"MLP, 48 x Linear(64, 64)": mlp, "TransformerEncoder, 4 layers, d_model 64": transformer,
          "CNN, 9 x Conv2d(16, 3x3) + BatchNorm": conv}


def reads_per_forward(model, x, getattr_fn):
    count = [0]

    def counting(module, name):
        count[0] += 1
        return getattr_fn(module, name)
    nn.Module.__getattr__ = counting
    try:
        model(x)
    finally:
        nn.Module.__getattr__ = getattr_fn
    return count[0]


def time_forwards(model, x, n):
    times = []
    for _ in range(n):
        t0 = time.thread_time()
        model(x)
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def measure(make, rounds, per_round):
    model, x = make()
    session = autopatch.enable(mode="multi_layer")
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(2):
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()
            if step == 0:   # autotune's switch: mode auto's watch would refuse nn.MultiheadAttention
                session.optimizer(opt).set_mode("forward")
        (entry,) = [o for o in autopatch.report()["optimizers"] if o["steps"]]
        assert entry["mode"] == "forward" and entry["fusion"]["deferred_steps"] == 1, entry
        model(x)   # applies the last step's pending updates: from here on nothing is pending
        patched = vars(nn.Module)["__getattr__"]
        sides = {"torch": patched.__wrapped__, "autopatch": patched}
        reads = reads_per_forward(model, x, patched)
        one = {side: [] for side in sides}
        first = {"m": next(m for m in model.modules() if m._parameters.get("weight") is not None)}
        for _ in range(5):
            for side, fn in sides.items():
                nn.Module.__getattr__ = fn
                one[side].append(min(timeit.repeat("m.weight", globals=first, number=20000, repeat=3)) / 20000)
        got = {"torch": [], "autopatch": []}
        for _, side in turns(("torch", "autopatch"), rounds):
            nn.Module.__getattr__ = sides[side]
            got[side].append(time_forwards(model, x, per_round))
        nn.Module.__getattr__ = patched
    finally:
        autopatch.disable()
    diffs = [a - t for a, t in zip(got["autopatch"], got["torch"])]
    return (reads, statistics.median(got["torch"]), statistics.median(got["autopatch"]), statistics.median(diffs),
            min(one["torch"]), min(one["autopatch"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--per-round", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"# {summary()}; {args.rounds} rounds x {args.per_round} forwards")
    rows = []
    for name, make in MODELS.items():
        reads, plain, patched, diff, one_plain, one_patched = measure(make, args.rounds, args.per_round)
        rows.append((name, reads, f"{plain * 1e6:.0f}", f"{patched * 1e6:.0f}",
                     f"{diff * 1e6:+.1f} ({diff / plain:+.1%})", f"{diff / reads * 1e9:+.0f}",
                     f"{one_plain * 1e9:.0f} / {one_patched * 1e9:.0f}"))
    print(markdown(("model", "attribute reads per forward", "torch's __getattr__, us/forward",
                    "autopatch's, us/forward", "difference, us (of the forward)", "difference per read, ns",
                    "one read alone, ns: torch's / autopatch's"), rows))


if __name__ == "__main__":
    main()
