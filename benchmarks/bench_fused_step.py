"""Side-by-side timing of the optimizer step: unpatched, torch's own fast paths, autopatch.

One run prints every table, so the ratios compare numbers taken under the same machine load:
contenders alternate within each round (in a rotating order), rounds repeat, medians are quoted.
Every autopatch contender must end with the same weights and optimizer state as the unpatched
one, bit for bit (with exact: rounding, one step agrees with the eager step to rounding), or the run
stops: a speed-up of a wrong computation is never reported.

    python benchmarks/bench_fused_step.py            # full run, a few minutes on 2 cores
    python benchmarks/bench_fused_step.py --quick    # smoke run, under a minute
"""

import argparse
import copy
import gc
import logging
import statistics
import sys
import time
import warnings

import torch

from autopatch.fusion.chunking import default_chunk_bytes
from harness.alternation import turns
from harness.machine import closing, load_average, summary
from harness.optimizers import BertAdam
from harness.adoption import adopt_alone, assert_fused
from harness.report import markdown
from harness.states import assert_trained_alike
from harness.steps import Contender
from harness.workloads import linear_relu, many_small, transformer

BYTES_PER_ELEM = 7 * 4   # read param, grad and both moments; write param and both moments
BIG_COPY_BYTES = 512 << 20
HUGE = 1 << 40           # a chunk size larger than any run: one chunk per run
SWEEP = [64 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 16 << 20, HUGE]
QUICK_SWEEP = [64 << 10, 256 << 10, 1 << 20, 4 << 20, HUGE]


WORKLOADS = {
    "a": ("(a) 100 residual blocks, width 64", many_small),
    "b": ("(b) TransformerEncoder 4 x d128", transformer),
    "c": ("(c) 4 x Linear 2048x2048", lambda: linear_relu(2048, 4, 32)),
}

OPTIMIZERS = {
    "AdamW": lambda params, **kw: torch.optim.AdamW(params, lr=1e-3, **kw),
    "BertAdam": lambda params, **kw: BertAdam(params, lr=1e-3, **kw),
}


class NotAvailable(Exception):
    pass


def median_step(c):
    return statistics.median(s.step for s in c.records())


def median_train(c):
    return statistics.median(s.total for s in c.records())


class CopyProbe:
    """``dst.copy_(src)``: the memory bandwidth a plain streaming kernel gets right now."""

    def __init__(self, nbytes):
        n = max(1, nbytes // 4)
        self.src, self.dst = torch.randn(n), torch.empty(n)
        self.dst.copy_(self.src)
        self.times = []
        self.steps = 0

    def run(self, steps, record=True):
        for _ in range(steps):
            self.steps += 1
            t0 = time.perf_counter()
            self.dst.copy_(self.src)
            if record:
                self.times.append(time.perf_counter() - t0)

    def gbps(self):
        return 2 * self.src.numel() * 4 / statistics.median(self.times) / 1e9


def under_autopatch(opt, chunk_bytes="auto", exact="bitwise"):
    """``opt`` in autopatch's multi_layer mode, as ``enable(mode='multi_layer')`` would put it,
    under a runtime of its own so differently configured contenders can alternate."""
    return adopt_alone(opt, "multi_layer", {"fusion.chunk_bytes": chunk_bytes, "fusion.exact": exact})


def build(kind, opt_name, base, batch, args, chunk_bytes="auto"):
    """A fresh copy of the model with the contender's optimizer, or NotAvailable(reason)."""
    model = copy.deepcopy(base)
    make = OPTIMIZERS[opt_name]
    if kind == "unpatched":
        return Contender("unpatched (for-loop)", model, make(model.parameters()), batch)
    if kind == "foreach":
        return Contender("torch foreach=True", model, make(model.parameters(), foreach=True), batch)
    if kind == "fused":
        return Contender("torch fused=True", model, make(model.parameters(), fused=True), batch)
    if kind == "compile":
        if args.no_compile:
            raise NotAvailable("skipped (--quick / --no-compile)")
        opt = make(model.parameters())
        c = Contender("torch.compile(opt.step)", model, opt, batch, step=torch.compile(opt.step))
        t0 = time.perf_counter()
        try:
            c.run(1, record=False)
        except Exception as e:  # no compiler, unsupported op...: report it, keep the others
            raise NotAvailable(f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
        c.setup_s = time.perf_counter() - t0
        return c
    if kind == "autopatch":
        opt = make(model.parameters())
        label = "autopatch multi_layer" if chunk_bytes == "auto" else chunk_label(chunk_bytes)
        return Contender(label, model, opt, batch, handle=under_autopatch(opt, chunk_bytes))
    if kind == "autopatch+rounding":
        if args.no_compile and opt_name == "BertAdam":
            raise NotAvailable("skipped (--quick / --no-compile: its route is compiled)")
        opt = make(model.parameters())
        handle = under_autopatch(opt, chunk_bytes, exact="rounding")
        c = Contender("autopatch multi_layer, exact: rounding", model, opt, batch, handle=handle)
        t0 = time.perf_counter()
        c.run(2, record=False)    # a chunk's first step is bitwise: the route runs from the second
        route = handle.describe().get("route", {})
        if route.get("route") == "bitwise":
            raise NotAvailable(f"route bitwise: {route.get('why')}")
        c.setup_s = time.perf_counter() - t0
        c.route = route
        return c
    raise ValueError(kind)


CONTENDERS = ["unpatched", "foreach", "fused", "compile", "autopatch", "autopatch+rounding"]
# torch has no foreach path or fused kernel for a hand-written optimizer; compile is timed on AdamW.
INAPPLICABLE = {("BertAdam", k) for k in ("foreach", "fused", "compile")}


class RecompileLimitHits(logging.Handler):
    """Once dynamo has compiled a function ``recompile_limit`` times it runs it eagerly from then
    on, saying so only in a log line: collect those lines so the table can say so too."""

    def __init__(self):
        super().__init__()
        self.hits = []
        logging.getLogger("torch._dynamo.convert_frame").addHandler(self)

    def emit(self, record):
        msg = record.getMessage()
        if "recompile_limit" in msg:
            self.hits.append(msg.splitlines()[1].split("function:")[-1].split("(")[0].strip())


def alternate(runners, rounds, steps, warmup):
    """Warm every runner up to the same step count (compiling contenders took their first step
    while being built), then rounds of ``steps`` each, the starting runner rotating."""
    for r in runners:
        r.run(max(0, warmup - r.steps), record=False)
    for _, r in turns(runners, rounds):
        gc.collect()
        r.run(steps)


def check_equal(ref, other):
    """``other`` trained to exactly the weights and optimizer state of ``ref``, and autopatch
    really ran its fused step (not a silent fallback)."""
    assert_trained_alike(other.name, ref.model.parameters(), other.model.parameters(), ref.opt, other.opt, ref.name)
    assert_fused(other.handle, other.name)


def check_one_step(c, opt_name):
    """A compiled step rounds differently and a deep net amplifies that over many steps, so
    check one step instead: from ``c``'s current weights and optimizer state, the unpatched eager
    optimizer and ``c`` take the same step and must agree to 1% of the update, per tensor (a
    skipped parameter or a wrong hyperparameter is off by the whole update)."""
    model = copy.deepcopy(c.model)
    opt = OPTIMIZERS[opt_name](model.parameters())
    # load_state_dict keeps tensors it is given as they are: without the copy both would share state.
    opt.load_state_dict(copy.deepcopy(c.opt.state_dict()))
    ref = Contender("unpatched (for-loop)", model, opt, c.batch)
    before = [p.detach().clone() for p in model.parameters()]
    ref.run(1, record=False)
    c.run(1, record=False)
    for i, (p0, a, b) in enumerate(zip(before, model.parameters(), c.model.parameters())):
        update = (a - p0).abs().max().item()
        diff = (a - b).abs().max().item()
        assert diff <= 1e-2 * update, f"{c.name}: one step of parameter {i} differs from " \
                                      f"unpatched by {diff:.3g}, the update is {update:.3g}"
    assert_fused(c.handle, c.name)


# -- reporting --------------------------------------------------------------------------------
def chunk_label(n):
    if n == HUGE:
        return "one chunk per run"
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def ratio_cell(t, ref):
    return f"{t / ref:.2f} ({ref / t:.1f}x)"


def numel(model):
    return sum(p.numel() for p in model.parameters())


LABELS = {"unpatched": "unpatched (for-loop)", "foreach": "torch foreach=True",
          "fused": "torch fused=True", "compile": "torch.compile(opt.step)",
          "autopatch": "autopatch multi_layer", "autopatch+rounding": "autopatch multi_layer, exact: rounding"}


def main_table(args):
    """Every contender on every workload and optimizer; returns the table, ratios and notes."""
    rows, verdict, notes = [], {}, []
    big = CopyProbe(BIG_COPY_BYTES)
    recompiles = None if args.no_compile else RecompileLimitHits()
    for wkey in args.workloads:
        title, make = WORKLOADS[wkey]
        torch.manual_seed(0)
        base, batch, _ = make()
        n = numel(base)
        # Same footprint as the step: a copy of 2P bytes into 2P bytes touches 4 x param bytes.
        probe = CopyProbe(2 * n * 4)
        for opt_name in OPTIMIZERS:
            if recompiles:
                # Start each cell as a fresh process would: AdamW.step is one code object for
                # every instance, and dynamo's recompile limit counts per code object.
                torch._dynamo.reset()
                recompiles.hits.clear()
            built, missing = {}, {}
            for kind in CONTENDERS:
                if (opt_name, kind) in INAPPLICABLE:
                    continue
                try:
                    built[kind] = build(kind, opt_name, base, batch, args)
                except NotAvailable as e:
                    missing[kind] = str(e)
            alternate(list(built.values()) + [probe, big], args.rounds, args.steps, args.warmup)
            ref = built["unpatched"]
            checked = {}
            if "autopatch" in built:
                check_equal(ref, built["autopatch"])
                checked["autopatch"] = "bit-equal to unpatched"
            if "autopatch+rounding" in built:
                check_one_step(built["autopatch+rounding"], opt_name)
                checked["autopatch+rounding"] = "one step agrees with unpatched to 1% of the update"
            ref_step, ref_train = median_step(ref), median_train(ref)
            for kind in CONTENDERS:
                wl = f"({wkey})"
                if kind in missing:
                    rows.append([wl, opt_name, LABELS[kind], "n/a", "", "n/a", "", "", "",
                                 missing[kind]])
                if kind not in built:
                    continue
                c = built[kind]
                s, t = median_step(c), median_train(c)
                gbps = n * BYTES_PER_ELEM / s / 1e9
                note = ""
                if kind == "autopatch+rounding":
                    note = f"route {c.route['route']}, first two steps {c.setup_s:.1f} s"
                if kind == "compile":
                    note = f"compile {c.setup_s:.1f} s (first step)"
                    if recompiles.hits:
                        note += (f"; dynamo hit its recompile limit on "
                                 f"{', '.join(sorted(set(recompiles.hits)))} and ran it eagerly "
                                 f"from then on")
                if c.handle is not None:
                    f = c.handle.describe()["fusion"]
                    # A route stepping torch's fused kernel per tensor plans no flat chunks.
                    chunks = (f"{f['chunks']} x {chunk_label(f['chunk_bytes'])} chunks" if f["chunk_bytes"]
                              else "no flat chunks")
                    note = ", ".join(filter(None, [note, chunks, checked[kind]]))
                rows.append([wl, opt_name, LABELS[kind], f"{s * 1e3:.2f}", ratio_cell(s, ref_step),
                             f"{t * 1e3:.2f}", ratio_cell(t, ref_train), f"{gbps:.1f}",
                             f"{100 * gbps / probe.gbps():.0f}%", note])
                verdict[(wkey, opt_name, kind)] = s / ref_step
            del built, ref
            gc.collect()
        notes.append(f"{title}: {len(list(base.parameters()))} tensors, "
                     f"{n / 1e6:.2f} M params; copy probe at the step's footprint "
                     f"({4 * n * 4 / 2**20:.1f} MiB touched): {probe.gbps():.1f} GB/s")
        del probe
    notes.append(f"copy probe, big buffer ({BIG_COPY_BYTES >> 20} MiB into {BIG_COPY_BYTES >> 20} "
                 f"MiB): {big.gbps():.1f} GB/s")
    header = ["", "optimizer", "contender", "step ms", "step vs unpatched", "train-step ms",
              "train vs unpatched", "step GB/s", "% of copy", "note"]
    return header, rows, verdict, notes


def sweep_table(args):
    """Step time of multi_layer at each chunk size, alternating with the unpatched run."""
    columns, cells, best = [], {}, []
    sizes = QUICK_SWEEP if args.quick else SWEEP
    default = None
    for wkey in ("a", "c"):
        if wkey not in args.workloads:
            continue
        title, make = WORKLOADS[wkey]
        torch.manual_seed(0)
        base, batch, _ = make()
        for opt_name in OPTIMIZERS:
            col = f"{title.split(' ')[0]} {opt_name}"
            columns.append(col)
            ref = build("unpatched", opt_name, base, batch, args)
            runs = [build("autopatch", opt_name, base, batch, args, chunk_bytes=b) for b in sizes]
            default = default_chunk_bytes(ref.opt)
            alternate([ref] + runs, args.rounds, args.steps, args.warmup)
            for c in runs:
                check_equal(ref, c)
            r = median_step(ref)
            times = {b: median_step(c) for b, c in zip(sizes, runs)}
            for b, c in zip(sizes, runs):
                chunks = c.handle.describe()["fusion"]["chunks"]
                cells[(b, col)] = f"{times[b] * 1e3:.2f} ms ({times[b] / r:.2f}, {chunks} ch)"
            cells[("unpatched", col)] = f"{r * 1e3:.2f} ms (1.00)"
            winner = min(times, key=times.get)
            fastest = times[winner]
            near = [chunk_label(b) for b in sizes if times[b] <= 1.05 * fastest]
            text = (f"{col}: fastest {chunk_label(winner)} ({fastest * 1e3:.2f} ms, "
                    f"{fastest / r:.2f} of unpatched); within 5% of it: {', '.join(near)}")
            if default in times:
                text += f"; the default {chunk_label(default)} takes {times[default] / fastest:.2f}x the fastest"
            best.append(text)
            del ref, runs
            gc.collect()
    header = ["chunk_bytes"] + columns
    rows = []
    for b in sizes + ["unpatched"]:
        label = "unpatched (for-loop)" if b == "unpatched" else chunk_label(b)
        if b == default:
            label += " (default)"
        rows.append([label] + [cells.get((b, col), "") for col in columns])
    return header, rows, best


def targets(verdict):
    """The issue's speed bar, each line MET / NOT MET with its number."""
    get = verdict.get
    lines = []

    def line(text, value, ok):
        state = "n/a" if value is None else ("MET" if ok(value) else "NOT MET")
        lines.append(f"- {text}: {state}" + ("" if value is None else f" ({value})"))

    for opt in OPTIMIZERS:
        v = get(("a", opt, "autopatch"))
        line(f"(a) {opt}: optimizer step >= 4x faster than unpatched",
             None if v is None else f"{1 / v:.1f}x", lambda _: v <= 0.25)
    for w in ("a", "b", "c"):
        ap, fu = get((w, "AdamW", "autopatch")), get((w, "AdamW", "fused"))
        line(f"({w}) AdamW: autopatch step no slower than torch fused=True",
             None if ap is None or fu is None else f"autopatch/fused = {ap / fu:.2f}",
             lambda _: ap <= fu)
    for opt in OPTIMIZERS:
        v = get(("c", opt, "autopatch"))
        line(f"(c) {opt}: step never slower than unpatched (ratio <= 1.05)",
             None if v is None else f"ratio {v:.2f}", lambda _: v <= 1.05)
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, help="rounds of alternation (default 5, quick 3)")
    ap.add_argument("--steps", type=int, help="steps per contender per round (default 4, quick 2)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per contender first")
    ap.add_argument("--quick", action="store_true", help="few rounds, short sweep, no torch.compile")
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    ap.add_argument("--no-sweep", action="store_true", help="leave the chunk-size sweep out")
    ap.add_argument("--workloads", default="abc", help="subset of a, b, c")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    args = ap.parse_args()
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.steps = args.steps or (2 if args.quick else 4)
    args.warmup = min(args.warmup, 2) if args.quick else args.warmup
    args.no_compile = args.no_compile or args.quick
    args.workloads = [w for w in "abc" if w in args.workloads]
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")

    started = time.perf_counter()
    print(f"# bench_fused_step: {summary()}")
    print(f"rounds {args.rounds} x steps {args.steps} (+{args.warmup} warm-up steps), medians over "
          f"{args.rounds * args.steps} steps; load average at start {load_average('/', 1)}\n")
    header, rows, verdict, notes = main_table(args)
    print(markdown(header, rows))
    print()
    for n in notes:
        print(f"- {n}")
    print("- BertAdam has no foreach path or fused kernel in torch; torch.compile is timed for "
          "AdamW only.")
    print("- step GB/s = elements x 28 bytes / median step time: an Adam step must read param, "
          "grad, exp_avg, exp_avg_sq and write param, exp_avg, exp_avg_sq (4 bytes each), for "
          "AdamW and BertAdam alike. The per-tensor implementations make about 20 elementwise "
          "passes, so their real traffic is higher wherever the data does not stay in cache. "
          "% of copy compares with copy_ at the same footprint (2 x bytes / time).")
    print("\nTargets:")
    print("\n".join(targets(verdict)))
    if not args.no_sweep:
        print(f"\nChunk-size sweep ({time.perf_counter() - started:.0f} s in so far), multi_layer "
              f"optimizer step: median ms (ratio vs unpatched, chunks)\n")
        header, rows, best = sweep_table(args)
        print(markdown(header, rows))
        print()
        for b in best:
            print(f"- {b}")
    print(f"\nEvery autopatch contender was checked after its last timed step: bitwise ones, "
          f"weights and optimizer state bit-for-bit equal to unpatched; exact: rounding, see its note. "
          f"{closing(started).capitalize()}.")


if __name__ == "__main__":
    sys.exit(main())
