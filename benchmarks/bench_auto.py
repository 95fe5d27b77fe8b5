"""How fast mode auto decides, and what deciding costs a run, against unpatched and against the
winning mode named from the start.

Every contender is a whole fresh run in a process of its own (auto must start from nothing each
time), the contenders of a round run one after the other in rotating order, rounds repeat, and
figures are medians of per-round ratios:

- ``quickstart``: ``examples/train_mlp.py`` (300 steps, default policy) zero-code, against the same
  run unpatched and with each fused mode named from the start; the step auto decided at (from its
  report) and the whole training loop's time against the run that named auto's choice;
- ``short``: 60-step runs of 8 x Linear(1024) with AdamW and of 100 residual blocks (400 tensors)
  with the hand-written BertAdam; the second half's time against unpatched's;
- ``matmul``: a 300-step run whose step is one large matmul (no mode can be much faster): what
  measuring costs, against unpatched's time;
- ``steady``: 400-step runs of the 400-tensor model with BertAdam, unpatched, auto and
  ``multi_layer`` named from the start: the median step of the second half (long after auto has
  decided), on the wall clock and on the training thread's CPU clock (which leaves out waiting
  for a core on a loaded machine). Whatever auto keeps after deciding would show here as auto
  slower than the mode it chose, named; and, whatever the load, as more function calls per step
  (counted over 20 steps after the timed ones, ``harness/calls.py``).

    python benchmarks/bench_auto.py            # every part, 5 rounds
    python benchmarks/bench_auto.py --quick    # one round of smaller runs
    python benchmarks/bench_auto.py --parts short --named   # and what each mode named gives
    python benchmarks/bench_auto.py --parts steady --rounds 3   # auto after it decides
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness.alternation import quartiles, turns  # noqa: E402
from harness.calls import calls_per_step  # noqa: E402
from harness.launch import child_env  # noqa: E402
from harness.machine import closing, summary  # noqa: E402
from harness.report import markdown  # noqa: E402

EXAMPLE = HERE.parent / "examples" / "train_mlp.py"
FUSED = ("multi_layer", "backward", "forward")
CALLS_OVER = 20     # steps whose function calls are counted after a run's timed steps
TARGETS = {"decided_by": 50, "quickstart": 1.10, "wide_mlp": 1.02, "many_small": 0.55, "matmul": 1.02,
           "steady": 0.50, "steady_vs_named": 1.02}


# -- one run, in the child process (``--run``) -----------------------------------------------------
def workload(name):
    import torch
    from torch import nn
    from harness import workloads
    from harness.optimizers import BertAdam
    torch.manual_seed(0)
    if name == "wide_mlp":
        model, batch, loss = workloads.linear_relu(1024, 8, 8)
        return model, torch.optim.AdamW(model.parameters()), batch, loss
    if name == "many_small":
        model, batch, loss = workloads.many_small()
        return model, BertAdam(model.parameters()), batch, loss
    if name == "matmul":
        model = nn.Linear(1024, 1024)
        return model, torch.optim.AdamW(model.parameters()), (torch.randn(512, 1024), None), workloads.square_loss
    raise SystemExit(f"unknown workload {name}")


def run_one(name, steps, out):
    """Train ``steps`` steps of ``name``; write each step's seconds and auto's figures to ``out``."""
    import autopatch
    model, opt, (x, y), loss_fn = workload(name)
    seconds, cpu_seconds = [], []
    def step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        seconds.append(time.perf_counter() - t0)
        cpu_seconds.append(time.thread_time() - c0)
    entry = autopatch.report()["optimizers"][0] if autopatch.is_enabled() else {}
    calls = calls_per_step(step, CALLS_OVER)     # after the timed steps, so they time nothing counted
    Path(out).write_text(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds, "auto": entry.get("auto", {}),
                                     "mode": entry.get("mode"), "calls_per_step": calls}))


# -- the parent ----------------------------------------------------------------------------------
def launch(argv, mode, tmp, tag):
    """Run ``argv`` as a contender: unpatched, or zero-code with ``mode`` (``auto`` or a mode)."""
    env = child_env(OMP_NUM_THREADS=1)
    report = tmp / f"{tag}.json"
    if mode != "unpatched":
        env.update(FUSEDOPT_ENABLE="1", FUSEDOPT_MODE=mode, FUSEDOPT_REPORT=str(report))
    done = subprocess.run([sys.executable, *map(str, argv)], env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise SystemExit(f"{tag} failed:\n{done.stderr[-3000:]}")
    return done.stdout, (json.loads(report.read_text()) if report.exists() else None)


def quickstart(rounds, steps, tmp):
    contenders = ["unpatched", "auto", *FUSED]
    loop = {c: [] for c in contenders}
    decided, chosen, losses, accuracy = [], [], [], []
    for r, c in turns(contenders, rounds):
        out, report = launch([EXAMPLE, "--steps", steps], c, tmp, f"qs-{r}-{c}")
        loop[c].append(float(re.search(r"in ([\d.]+) s", out).group(1)))
        if c == "auto":
            auto = report["optimizers"][0]["auto"]
            decided.append(auto.get("decided_at_step"))
            chosen.append(auto.get("chosen", "still measuring"))
            found = [float(v) for v in re.findall(r"loss ([\d.]+)", out)]
            losses.append((found[0], found[-1]))
            accuracy.append(float(re.search(r"test accuracy ([\d.]+)%", out).group(1)))
    ratio_named = [loop["auto"][i] / loop[chosen[i]][i] if chosen[i] in loop else None for i in range(rounds)]
    ratio_off = [a / u for a, u in zip(loop["auto"], loop["unpatched"])]
    return {"loop_s": {c: statistics.median(v) for c, v in loop.items()}, "decided_at_step": decided,
            "chosen": chosen, "vs_named": [x for x in ratio_named if x is not None], "vs_unpatched": ratio_off,
            "loss_first_last": losses, "test_accuracy": accuracy}


def timed_runs(name, steps, rounds, tmp, keep, named=()):
    """auto (and the modes in ``named``, each named from the start) against unpatched on ``name``;
    ``keep(seconds)`` picks the steps compared."""
    got = {"auto": [], "unpatched": [], **{mode: [] for mode in named}}
    decided = []
    for r, c in turns(list(got), rounds):
        out = tmp / f"{name}-{r}-{c}.out"
        launch([__file__, "--run", name, "--steps", steps, "--out", out], c, tmp, f"{name}-{r}-{c}")
        rec = json.loads(out.read_text())
        got[c].append(sum(keep(rec["seconds"])))
        if c == "auto":
            decided.append(rec["auto"].get("decided_at_step"))
    return {"ratios": [a / u for a, u in zip(got["auto"], got["unpatched"])], "decided_at_step": decided,
            "unpatched_s": statistics.median(got["unpatched"]),
            "named": {mode: [m / u for m, u in zip(got[mode], got["unpatched"])] for mode in named}}


def steady(rounds, steps, tmp):
    """Unpatched, auto and multi_layer named, in turns: per run, the median step of its second
    half on each clock; per round, auto's and multi_layer's over unpatched's and auto's over
    multi_layer's. And what no optimizer step can go below: multi_layer named's forward and
    backward (its report's per-step breakdown) over unpatched's step."""
    contenders = ("unpatched", "auto", "multi_layer")
    median_step = {clock: {c: [] for c in contenders} for clock in ("seconds", "cpu_seconds")}
    calls = {c: [] for c in contenders}
    decided, chosen, parts = [], [], []
    for r, c in turns(contenders, rounds):
        out = tmp / f"steady-{r}-{c}.out"
        _, report = launch([__file__, "--run", "many_small", "--steps", steps, "--out", out], c, tmp,
                           f"steady-{r}-{c}")
        rec = json.loads(out.read_text())
        if c == "multi_layer":
            parts.append(report["breakdown"]["median_ms"])
        for clock, runs in median_step.items():
            runs[c].append(statistics.median(rec[clock][steps // 2:]))
        calls[c].append(rec["calls_per_step"])
        if c == "auto":
            decided.append(rec["auto"].get("decided_at_step"))
            chosen.append(rec["mode"])
    figures = {}
    for clock, runs in median_step.items():
        u, a, m = runs["unpatched"], runs["auto"], runs["multi_layer"]
        figures[clock] = {"ms": {c: [round(1e3 * x, 2) for x in v] for c, v in runs.items()},
                          "auto_vs_unpatched": [x / y for x, y in zip(a, u)],
                          "named_vs_unpatched": [x / y for x, y in zip(m, u)],
                          "auto_vs_named": [x / y for x, y in zip(a, m)]}
    floor = [(p["forward"] + p["backward"]) / (1e3 * u) for p, u in zip(parts, median_step["seconds"]["unpatched"])]
    return {"figures": figures, "decided_at_step": decided, "chosen": chosen, "calls_per_step": calls,
            "floor_vs_unpatched": floor, "named_ms": {k: statistics.median(p[k] for p in parts)
                                                      for k in ("forward", "backward", "optimizer")}}


def fmt_ratios(values):
    lo, hi = quartiles(values)
    return f"{statistics.median(values):.3f} ({lo:.3f}-{hi:.3f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parts", default="quickstart,short,matmul")
    ap.add_argument("--named", action="store_true",
                    help="short runs: also each fused mode named from the start, what auto's choice can give")
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=60, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        run_one(args.run, args.steps, args.out)
        return
    started = time.perf_counter()
    rounds = 1 if args.quick else args.rounds
    print(summary())
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        parts = args.parts.split(",")
        if "quickstart" in parts:
            q = quickstart(rounds, 60 if args.quick else 300, tmp)
            rows.append(["quick start (examples/train_mlp.py), whole loop vs auto's choice named",
                         fmt_ratios(q["vs_named"]) if q["vs_named"] else "-", f"<= {TARGETS['quickstart']}",
                         f"decided at steps {q['decided_at_step']} (target <= {TARGETS['decided_by']}); "
                         f"chose {q['chosen']}; vs unpatched {fmt_ratios(q['vs_unpatched'])}; loss "
                         f"{q['loss_first_last'][0][0]:.2f} -> {q['loss_first_last'][0][1]:.2f}, test accuracy "
                         f"{statistics.median(q['test_accuracy']):.1f}%"])
            print(json.dumps(q, indent=1))
        if "short" in parts:
            for name, title in (("wide_mlp", "8 x Linear(1024), AdamW"), ("many_small", "400 tensors, BertAdam")):
                s = timed_runs(name, 60, rounds, tmp, keep=lambda sec: sec[len(sec) // 2:],
                               named=FUSED if args.named else ())
                named = "".join(f"; {mode} named {fmt_ratios(r)}" for mode, r in s["named"].items())
                rows.append([f"60 steps, {title}: second half vs unpatched", fmt_ratios(s["ratios"]),
                             f"<= {TARGETS[name]}", f"decided at steps {s['decided_at_step']}{named}"])
        if "matmul" in parts:
            m = timed_runs("matmul", 100 if args.quick else 300, rounds, tmp, keep=lambda sec: sec)
            rows.append(["300 steps, one Linear(1024) at batch 512 (no mode faster): whole run vs unpatched",
                         fmt_ratios(m["ratios"]), f"<= {TARGETS['matmul']}",
                         f"decided at steps {m['decided_at_step']}; unpatched {m['unpatched_s']:.1f} s"])
        if "steady" in parts:
            steps = 100 if args.quick else 400
            st = steady(rounds, steps, tmp)
            for clock, name in (("seconds", "wall clock"), ("cpu_seconds", "CPU clock")):
                f = st["figures"][clock]
                ms = ", ".join(f"{c} {statistics.median(v):.2f}" for c, v in f["ms"].items())
                rows.append([f"{steps} steps, 400 tensors, BertAdam, second half ({name}): auto vs unpatched",
                             fmt_ratios(f["auto_vs_unpatched"]), f"<= {TARGETS['steady']}",
                             f"multi_layer named {fmt_ratios(f['named_vs_unpatched'])}; median step ms: {ms}"])
                rows.append([f"same ({name}): auto vs multi_layer named", fmt_ratios(f["auto_vs_named"]),
                             f"<= {TARGETS['steady_vs_named']}",
                             f"auto chose {st['chosen']}, decided at steps {st['decided_at_step']}"])
            calls = {c: statistics.median(v) for c, v in st["calls_per_step"].items()}
            ms = ", ".join(f"{k} {v:.2f}" for k, v in st["named_ms"].items())
            rows.append(["same: multi_layer named's forward + backward over unpatched's step (an optimizer "
                         "step of no time at all)", fmt_ratios(st["floor_vs_unpatched"]), "-",
                         f"multi_layer named, median ms: {ms} (its report's breakdown)"])
            rows.append([f"same, after the timed steps: function calls per step, auto vs multi_layer named",
                         f"{calls['auto']:.0f} vs {calls['multi_layer']:.0f}", "equal",
                         f"unpatched {calls['unpatched']:.0f}; auto chose {st['chosen']}"])
            print(json.dumps(st, indent=1))
    print()
    print(markdown(["what", "auto (median, quartiles)", "target", "notes"], rows))
    print(closing(started))


if __name__ == "__main__":
    main()
