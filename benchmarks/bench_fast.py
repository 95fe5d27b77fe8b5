"""Whole training-step time under the builtin policy ``fast`` (``fusion.exact: rounding``) on CPU.

Workload: 4 x ``TransformerEncoderLayer(128, 4, 512)``, AdamW with torch's defaults, batch
8 x 32. Contenders, all in one process, each with its own copy of the model and its own optimizer
(autopatch contenders each under a runtime of their own, so their policies differ): unpatched
(torch's default implementation), unpatched ``fused=True``, autopatch's default policy (bitwise),
and policy ``fast`` with ``multi_layer``, ``backward`` and ``auto``.

Method: every contender trains the same warm-up steps: first, one contender at a time, the steps
the modes that watch the first steps watch (a watch sees the whole process's autograd), then in
turns until mode auto has chosen, and at least ``--warmup``; then in each of ``--rounds`` rounds every contender, starting one rotating, runs
``--steps`` steps; a step is ``zero_grad(); loss = model(x).square().mean(); loss.backward();
opt.step()`` timed with ``perf_counter``. Per round a contender's figure is its median step; its
ratio is the median over rounds of per-round ratios against unpatched, so both sides of a ratio
were measured seconds apart. At the end the default policy must equal unpatched bit for bit, and
every ``fast`` contender is compared with unpatched: its route and the probe's deviation from the
report, and the largest weight difference relative to the weight's magnitude (after hundreds of
steps on one batch, rounding differences grow as large for torch's own ``fused=True``). The time
inside ``opt.step()`` is shown too, and the ratio an optimizer taking no time would reach.

    PYTHONPATH=$PWD python benchmarks/bench_fast.py            # a few minutes on 2 cores
    PYTHONPATH=$PWD python benchmarks/bench_fast.py --quick    # smoke run, under a minute
"""

import argparse
import copy
import statistics
import sys
import time

import torch
from autopatch import policy as ap_policy

from harness.alternation import quartiles, round_ratios, turns
from harness.machine import closing, summary
from harness.adoption import adopt_alone, auto_has_chosen
from harness.report import markdown
from harness.steps import Contender
from harness.workloads import encoder

CONTENDERS = [  # (name, optimizer options, policy, policy overrides); policy None: unpatched
    ("unpatched", {}, None, {}),
    ("unpatched fused=True", {"fused": True}, None, {}),
    ("autopatch default (bitwise)", {}, "default", {}),
    ("autopatch fast, multi_layer", {}, "fast", {"fusion.mode": "multi_layer"}),
    ("autopatch fast, backward", {}, "fast", {"fusion.mode": "backward"}),
    ("autopatch fast, auto", {}, "fast", {}),
]


def contender(name, base, x, options, policy, overrides):
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), **options)
    handle = adopt_alone(opt, policy, overrides) if policy is not None else None
    return Contender(name, model, opt, (x, None), handle=handle)


def choosing(c):
    """Mode auto is still measuring (the other modes have chosen once their watch is over)."""
    if c.handle is None:
        return False
    entry = c.handle.describe()
    return "auto" in entry and not auto_has_chosen(entry)


def medians(c, phase=None):
    """Per round, the median step (or the median time of one phase)."""
    return [statistics.median(s.total if phase is None else getattr(s, phase) for s in r) for r in c.rounds]


def relative_diff(a_model, b_model):
    return max(((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()
               for a, b in zip(a_model.parameters(), b_model.parameters()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per contender per round")
    ap.add_argument("--warmup", type=int, default=20, help="warm-up steps, at least")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a machine shared with other jobs, OpenMP's "
                         "barriers wait for a descheduled thread and swamp what is measured)")
    ap.add_argument("--quick", action="store_true", help="3 rounds of 4 steps")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 3, 4, 8
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    torch.manual_seed(0)
    base = encoder()
    x = torch.randn(8, 32, 128, generator=torch.Generator().manual_seed(1))
    cs = [contender(name, base, x, *rest) for name, *rest in CONTENDERS]
    # The modes that watch the first steps watch this process's autograd: each watches alone.
    watch = 1 + max(ap_policy.load(policy, overrides=overrides).fusion.observe_steps
                    for _, _, policy, overrides in CONTENDERS if policy)
    for c in cs:
        c.run(watch, record=False)
    warm = watch
    while warm < args.warmup or any(choosing(c) for c in cs):
        for c in cs:
            c.run(1, record=False)
        warm += 1
        if warm % 50 == 0:
            print(f"warm-up step {warm}, still choosing: "
                  + ", ".join(c.name for c in cs if choosing(c)), file=sys.stderr)
        if warm > 2000:
            sys.exit("mode auto did not choose within 2000 steps")
    warm_s = time.perf_counter() - started
    for _, c in turns(cs, args.rounds):
        c.run(args.steps)
    for c in cs:
        c.opt.state_dict()    # applies a pending update of mode forward, as saving a checkpoint does
    ref = cs[0]
    rows, ratios = [], {}
    for c in cs:
        rs = round_ratios(c.rounds, ref.rounds)
        ratios[c.name] = statistics.median(rs)
        lo, hi = quartiles(rs)
        note = ""
        if c.handle is not None:
            d = c.handle.describe()
            route = d.get("route") or {}
            note = f"mode {d['mode']}; route {route.get('route')}"
            if route.get("deviation") is not None:
                note += f" (probe deviation {route['deviation']:.1e}, bound {route['bound']:.0e})"
            if route.get("compile_seconds"):
                note += f", compile {route['compile_seconds']:.1f} s"
        if c is not ref:
            diff = relative_diff(ref.model, c.model)
            note += ("; " if note else "") + ("bitwise equal to unpatched" if diff == 0
                                              else f"weights differ by up to {diff:.1e} (relative)")
            if c.name.startswith("autopatch default") and diff != 0:
                sys.exit(f"{c.name} is not bitwise equal to unpatched: {diff:.3g}")
        rows.append([c.name, f"{1e3 * statistics.median(medians(c)):.2f}",
                     f"{1e3 * statistics.median(medians(c, 'step')):.2f}", f"{ratios[c.name]:.3f}",
                     f"{lo:.3f}-{hi:.3f}", note])
    print("## policy fast on the CPU transformer (4 x d128, AdamW, batch 8 x 32)\n")
    print(f"- {summary()}")
    print(f"- {warm} warm-up steps each ({warm_s:.0f} s), then {args.rounds} rounds x {args.steps} "
          f"steps; {closing(started)}\n")
    print(markdown(["contender", "step ms (median)", "in opt.step() ms", "x unpatched (median of rounds)",
                    "quartiles", "notes"], rows))
    best = min((n for n in ratios if n.startswith("autopatch fast")), key=ratios.get)
    print(f"\nTarget: policy fast <= 0.85x unpatched: best {best} at {ratios[best]:.3f}x "
          f"({'met' if ratios[best] <= 0.85 else 'NOT met'}); torch fused=True at "
          f"{ratios['unpatched fused=True']:.3f}x")
    floor = statistics.median([(s - o) / s for s, o in zip(medians(ref), medians(ref, "step"))])
    print(f"An optimizer step taking no time at all would reach {floor:.3f}x (unpatched's share of "
          f"the step outside opt.step(), median of rounds). Mode backward updates inside backward "
          f"and mode forward inside the next forward: their opt.step() time shrinks by design.")


if __name__ == "__main__":
    main()
