"""Whole training-step time and peak memory of every fusion mode, next to unpatched and torch's fused AdamW.

Each contender trains in a process of its own, forked before any tensor work: global hooks of one
mode (forward fusion's module pre-hook, mode auto's watch) can never slow another contender, and
each process's peak memory is its own. Mode auto warms up first, alone, so it measures its
candidates on a machine the other contenders leave alone; it warms up until it has chosen (its
figures, from ``autopatch.report()``, are printed), and the others then warm up as many steps, so
every contender trains the same steps. The processes then take turns: in every round each runs
``--steps`` training steps while the others wait, the starting one rotating; medians over all
rounds are quoted, and ratios are the median of per-round ratios against unpatched, so both sides
of a ratio were measured minutes apart at most.

A step is ``zero_grad(); loss = f(model(x)); loss.backward(); opt.step()``, timed per phase with
``perf_counter``: forward (model and loss), backward, optimizer (``zero_grad`` plus ``step``).
On a machine shared with other jobs, ``--clock cpu`` times the same phases in the training
thread's CPU time instead (with one torch thread, every op and the CPU autograd engine run in that
thread), which leaves out the time the process waited for a core.
Where the update runs is the point of the fusion modes: in mode backward it is inside backward,
in mode forward inside the next forward, so their "optimizer" bar shrinks and the others grow.

Peak memory is the process's peak resident set (``VmHWM``) over steps after warm-up: each
worker first returns freed heap to the system (``malloc_trim``) and resets the peak
(``/proc/self/clear_refs``), so the number is the steady-state training peak, not one left over
from start-up or from the multi_layer steps run while watching. The table's memory columns come
from a second phase, fresh processes per contender with glibc's mmap threshold pinned (see
``MEMORY_MMAP_THRESHOLD``), so they follow what the tensors need; the timing processes' own peak,
under glibc's default behaviour, is shown beside it.

Every autopatch contender must end with the same model and optimizer state as unpatched,
``torch.equal`` on every tensor, or the run stops; the mode each one actually ran comes from
``autopatch.report()``.

    python benchmarks/bench_fusion_modes.py            # full run, 5 to 10 minutes
    python benchmarks/bench_fusion_modes.py --quick    # smoke run, under a minute
"""

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

import autopatch
from harness.alternation import median_ms, quartiles, round_ratios
from harness.machine import closing, summary
from harness.memory import peak_memory_bytes, pin_mmap_threshold, reset_peak_memory
from harness.optimizers import BertAdam
from harness.adoption import auto_has_chosen
from harness.processes import Worker, in_turns, serve
from harness.report import markdown
from harness.states import compare_states
from harness.steps import train_step
from harness.workloads import cross_entropy, linear_relu, many_small, mobilenet_v2, square_loss, stack, transformer

ROOT = Path(__file__).resolve().parent.parent
CONTENDERS = ["unpatched", "fused", "multi_layer", "backward", "forward", "auto"]
AUTOPATCH_MODES = ("multi_layer", "backward", "forward", "auto")
LABELS = {"unpatched": "unpatched (default)", "fused": "torch fused=True", "multi_layer": "multi_layer",
          "backward": "backward", "forward": "forward", "auto": "auto"}
PHASES = ("forward", "backward", "optimizer")
TIMEOUT = 1800            # seconds any one answer of a contender may take (auto's warm-up the longest)


# -- workloads --------------------------------------------------------------------------------
def w_mobilenet():
    return mobilenet_v2(), (torch.randn(8, 3, 64, 64), torch.randint(0, 100, (8,))), cross_entropy


def w_linear_stack():
    """256 bias-free 256 x 256 layers: 64 MiB of gradients in equal tensors, where a chunk-sized
    copy of the gradients, or gradients held for a whole chunk in backward, shows at once."""
    return stack(256, 256, bias=False), (torch.randn(8, 256), None), square_loss


# key -> (title, builder, optimizer)
WORKLOADS = {
    "mobilenet": ("MobileNetV2 x0.35, 64x64, batch 8", w_mobilenet, "AdamW"),
    "transformer": ("TransformerEncoder 4 x d128, batch 8 x 32", transformer, "AdamW"),
    "many_small": ("100 residual blocks, width 64, batch 32", many_small, "BertAdam"),
    "wide_mlp": ("8 x Linear 1024x1024, batch 8 (memory)", lambda: linear_relu(1024, 8, 8), "AdamW"),
    "linear_stack": ("256 x Linear 256x256 no bias, batch 8 (memory)", w_linear_stack, "AdamW"),
}


def make_optimizer(name, params, contender):
    if name == "BertAdam":
        return BertAdam(params)
    return torch.optim.AdamW(params, fused=True) if contender == "fused" else torch.optim.AdamW(params)


def available(workload, contender):
    """None, or why this contender has no entry for the workload."""
    if contender == "fused" and WORKLOADS[workload][2] != "AdamW":
        return "the hand-written optimizer has no fused kernel"
    return None


# The memory phase pins glibc's mmap threshold (harness/memory.py): every tensor of 64 KiB or more
# gets its own mapping, so the resident size follows the memory the tensors need.
MEMORY_MMAP_THRESHOLD = 64 << 10


# -- one contender, in its own process ----------------------------------------------------------
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


class Job:
    """A contender's model, optimizer and batch: warm up, then rounds on request; at the end its
    peak memory, the mode that ran and (when given a path) its final state for the check."""

    def __init__(self, workload, contender, opts):
        if opts["mmap_threshold"]:
            pin_mmap_threshold(opts["mmap_threshold"])
        warnings.filterwarnings("ignore")
        torch.set_num_threads(opts["threads"])
        torch.manual_seed(0)
        _, build, opt_name = WORKLOADS[workload]
        self.model, self.batch, self.loss_fn = build()
        self.patched = contender in AUTOPATCH_MODES
        if self.patched:
            fusion = {"observe_steps": opts["observe_steps"]}
            if opts["measure_steps"]:
                fusion["measure_steps"] = opts["measure_steps"]
            autopatch.enable(mode=contender, chunk_bytes=opts["chunk_bytes"], fusion=fusion)
        self.opt = make_optimizer(opt_name, self.model.parameters(), contender)
        self.opts, self.reset_ok = opts, False

    def hello(self):
        params = list(self.model.parameters())
        return {"tensors": len(params), "grad_bytes": sum(p.numel() * p.element_size() for p in params)}

    def train(self, n, clock=time.perf_counter):
        """(forward, backward, optimizer) seconds per step; optimizer is zero_grad plus step."""
        out = []
        for _ in range(n):
            s = train_step(self.model, self.opt, self.batch, self.loss_fn, clock)
            out.append((s.forward, s.backward, s.zero_grad + s.step))
        return out

    def warmup(self, steps):
        """``steps`` steps; None (mode auto, alone on the machine): the policy's warm-up, until it
        has chosen, then a few more in the chosen mode, so the timed rounds see only that mode."""
        if steps is None:
            self.train(self.opts["warmup"])
            steps = self.opts["warmup"]
            while not auto_has_chosen(autopatch.report()["optimizers"][0]):
                self.train(1)
                steps += 1
                if steps > 100_000:
                    raise RuntimeError("mode auto did not choose within 100000 steps")
            self.train(3)
            steps += 3
        else:
            self.train(steps)
        self.reset_ok = reset_peak_memory()
        return {"warmup_steps": steps, "reset_ok": self.reset_ok}

    def run(self, n):
        return self.train(n, CLOCKS[self.opts["clock"]])

    def finish(self, state_path):
        out = {"peak_bytes": peak_memory_bytes(self.reset_ok)}
        if self.patched:
            rep = autopatch.report()["optimizers"][0]
            out.update(mode=rep["mode"], reason=rep["reason"], auto=rep.get("auto"))
        if state_path:
            torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}, state_path)
        if self.patched:
            autopatch.disable()
        return out


def run_workload(ctx, key, args, tmp, memory=False):
    """All contenders of one workload, taking turns; per contender its info (hello, warm-up,
    finish), its rounds (per round, the (forward, backward, optimizer) seconds of each step) and
    where its final state was saved.

    ``memory``: the memory phase instead, fresh processes with the mmap threshold pinned, warmed
    up just past the watch, then a few steps each; only their peaks are used.
    """
    opts = dict(threads=args.threads, observe_steps=args.observe_steps, chunk_bytes=args.chunk_bytes,
                clock=args.clock, measure_steps=args.measure_steps,
                warmup=args.observe_steps + 2 if memory else args.warmup,   # decided at step 1, watched, then fused
                mmap_threshold=MEMORY_MMAP_THRESHOLD if memory else None)
    rounds, steps = (1, args.memory_steps) if memory else (args.rounds, args.steps)
    names = [c for c in CONTENDERS if available(key, c) is None]
    workers = {c: Worker(ctx, serve, Job, key, c, opts, timeout=TIMEOUT) for c in names}
    runs = {c: {"info": w.answer(), "state": None if memory else os.path.join(tmp, f"{key}-{c}.pt")}
            for c, w in workers.items()}
    # Mode auto warms up alone: it measures; then it says how many steps the others take.
    runs["auto"]["info"].update(workers["auto"].ask("warmup"))
    others = [c for c in names if c != "auto"]
    for c in others:
        workers[c].send("warmup", runs["auto"]["info"]["warmup_steps"])
    for c in others:
        runs[c]["info"].update(workers[c].answer())
    for c, got in in_turns(workers, rounds, "run", steps).items():
        runs[c]["rounds"] = got
    for c, w in workers.items():
        runs[c]["info"].update(w.ask("finish", runs[c]["state"]))
        w.close()
    return runs


# -- checking and reporting -------------------------------------------------------------------
def compare(ref_path, path):
    """(equal bit for bit, largest absolute difference in the model's weights and buffers)."""
    return compare_states(torch.load(ref_path), torch.load(path))


def summarise(key, runs, memory_runs):
    """Per contender: medians, ratios against unpatched and multi_layer, memory, mode that ran."""
    ref = runs["unpatched"]
    peak = {name: r["info"]["peak_bytes"] / 2**20 for name, r in memory_runs.items()}   # empty when skipped
    rows = {}
    for name, r in runs.items():
        info, steps = r["info"], [s for rnd in r["rounds"] for s in rnd]
        ratios = round_ratios(r["rounds"], ref["rounds"])
        equal, worst = compare(ref["state"], r["state"])
        if name in AUTOPATCH_MODES and not equal:
            raise AssertionError(f"{key}: autopatch {name} did not train like unpatched "
                                 f"(largest weight difference {worst:.3g})")
        rows[name] = {
            "total": median_ms([sum(s) for s in steps]), "ratio": statistics.median(ratios),
            "ratio_q": quartiles(ratios),
            "vs_multi_layer": statistics.median(round_ratios(r["rounds"], runs["multi_layer"]["rounds"])),
            **{ph: median_ms([s[i] for s in steps]) for i, ph in enumerate(PHASES)},
            "peak_mb": peak.get(name),
            "peak_delta_mb": peak[name] - peak["unpatched"] if peak else None,
            "peak_delta_default_mb": (info["peak_bytes"] - ref["info"]["peak_bytes"]) / 2**20,
            "equal": equal, "max_diff": worst, "mode": info.get("mode"), "reason": info.get("reason"),
            "auto": info.get("auto"),
        }
    auto = rows["auto"]["auto"]
    # The fastest contender among the modes auto's watch allowed (off is unpatched here).
    allowed = [m for m in auto["candidates"] if m not in auto["ruled_out"]]
    fastest = min(allowed, key=lambda m: rows["unpatched" if m == "off" else m]["ratio"])
    name = "unpatched" if fastest == "off" else fastest
    rows["auto"].update(fastest=fastest,
                        vs_fastest=statistics.median(round_ratios(runs["auto"]["rounds"], runs[name]["rounds"])))
    return ref["info"], rows


def results_table(results):
    header = ["workload", "contender", "mode that ran", "step ms", "vs unpatched (quartiles)",
              "vs multi_layer", "forward ms", "backward ms", "optimizer ms", "peak RSS MiB",
              "peak vs unpatched MiB", "same, glibc default MiB", "same as unpatched"]
    rows = []
    for key, (info, by_name) in results.items():
        title, _, opt_name = WORKLOADS[key]
        label = f"{title}; {opt_name}; {info['tensors']} tensors, grads {info['grad_bytes'] / 2**20:.1f} MiB"
        for name in CONTENDERS:
            why = available(key, name)
            if why:
                rows.append([label, LABELS[name], "n/a"] + [""] * 9 + [why])
                continue
            r = by_name[name]
            same = "bitwise" if r["equal"] else f"no: model state differs by up to {r['max_diff']:.1e}"
            lo, hi = r["ratio_q"]
            rows.append([label, LABELS[name], r["mode"] or "-", f"{r['total']:.1f}",
                         f"{r['ratio']:.2f} ({lo:.2f}-{hi:.2f})", f"{r['vs_multi_layer']:.2f}",
                         f"{r['forward']:.1f}", f"{r['backward']:.1f}", f"{r['optimizer']:.1f}",
                         "-" if r["peak_mb"] is None else f"{r['peak_mb']:.1f}",
                         "-" if r["peak_delta_mb"] is None else f"{r['peak_delta_mb']:+.1f}",
                         f"{r['peak_delta_default_mb']:+.1f}", same])
            label = ""
    return markdown(header, rows)


# The bars: auto's step-time ratio per workload, and the steady-state peak of each mode against
# unpatched as a share of the gradient bytes, judged where gradients are tens of MiB (on the small
# models autopatch's own few MiB of code and bookkeeping are as large as the gradients).
TIME_TARGETS = {"transformer": 0.85, "many_small": 0.5}
MEMORY_WORKLOADS = ("wide_mlp", "linear_stack")
MEMORY_TARGETS = {"multi_layer": 0.10, "forward": 0.10, "backward": -0.50}


def peak_above_unpatched(info, by_name, mode):
    """(MiB by which ``mode``'s peak is above unpatched's, that as a share of the gradients), from
    the memory phase, or from the timing processes when it was skipped."""
    r = by_name[mode]
    delta = r["peak_delta_default_mb"] if r["peak_delta_mb"] is None else r["peak_delta_mb"]
    return delta, delta * 2**20 / info["grad_bytes"]


AUTO_LIMIT = 1.02          # auto never slower than unpatched, beyond this
AUTO_VS_FASTEST = 1.03     # and within this of the fastest mode its watch allows


def targets(results):
    lines = []

    def line(text, ok, detail):
        lines.append(f"- {text}: {'n/a' if ok is None else 'MET' if ok else 'NOT MET'} ({detail})")

    for key, (_, by_name) in results.items():
        r = by_name["auto"]
        line(f"auto <= {AUTO_LIMIT}x unpatched on {key}", r["ratio"] <= AUTO_LIMIT,
             f"{r['ratio']:.2f}x, auto ran {r['mode']}")
        line(f"auto within {AUTO_VS_FASTEST - 1:.0%} of the fastest mode its watch allows on {key}",
             r["vs_fastest"] <= AUTO_VS_FASTEST,
             f"{r['vs_fastest']:.3f}x the fastest, {r['fastest']}; auto ran {r['mode']}")

    for key, limit in TIME_TARGETS.items():
        text = f"auto <= {limit}x unpatched step time on {key} ({WORKLOADS[key][2]})"
        if key not in results:
            line(text, None, "workload not run")
            continue
        by_name = results[key][1]
        r, ref = by_name["auto"], by_name["unpatched"]
        floor = (ref["forward"] + ref["backward"]) / ref["total"]
        line(text, r["ratio"] <= limit,
             f"{r['ratio']:.2f}x, auto ran {r['mode']}; unpatched forward + backward alone, i.e. an "
             f"optimizer costing nothing, would be {floor:.2f}x")
    for key in results:
        for mode, bound in MEMORY_TARGETS.items():
            delta, share = peak_above_unpatched(*results[key], mode)
            detail = f"{delta:+.1f} MiB, {100 * share:+.0f}% of the gradients; ran {results[key][1][mode]['mode']}"
            if key in MEMORY_WORKLOADS:
                line(f"{mode} peak <= unpatched {100 * bound:+.0f}% of the gradient bytes on {key}",
                     share <= bound, detail)
            else:
                lines.append(f"- (for information) {mode} peak vs unpatched on {key}: {detail}")
    return "\n".join(lines)


def plot(results, path, clock):
    """Stacked bars of the median forward / backward / optimizer time, one panel per workload;
    a dashed line marks the step time the issue asks of mode auto."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results)
    cols = 2 if len(keys) > 1 else 1
    nrows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(7.5 * cols, 4.4 * nrows + 0.8), squeeze=False)
    colours = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868"}
    for ax, key in zip(axes.flat, keys):
        info, by_name = results[key]
        names = [n for n in CONTENDERS if n in by_name]
        ticks = [LABELS[n].replace(" (default)", "") +
                 (f"\nran {by_name[n]['mode']}" if by_name[n]["mode"] not in (None, n) else "") for n in names]
        bottom = [0.0] * len(names)
        for ph in PHASES:
            vals = [by_name[n][ph] for n in names]
            ax.bar(range(len(names)), vals, bottom=bottom, color=colours[ph], label=f"{ph} (median)", width=0.65)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, n in enumerate(names):
            r = by_name[n]
            ax.plot([i - 0.33, i + 0.33], [r["total"]] * 2, color="black", lw=1.2,
                    label="whole step (median)" if i == 0 else None)
            ax.text(i, max(bottom[i], r["total"]) * 1.02, f"{r['total']:.0f} ms\n{r['ratio']:.2f}x",
                    ha="center", va="bottom", fontsize=8)
        title, _, opt_name = WORKLOADS[key]
        title = f"{title}; {opt_name}, {info['tensors']} tensors"
        if key in TIME_TARGETS:
            ax.axhline(TIME_TARGETS[key] * by_name["unpatched"]["total"], color="crimson", ls="--", lw=1,
                       label="target for auto")
            title += f"\ntarget for auto: {TIME_TARGETS[key]}x unpatched (dashed)"
        ax.set_xticks(range(len(names)), ticks, fontsize=8)
        ax.set_ylim(0, max(max(bottom), max(by_name[n]["total"] for n in names)) * 1.25)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("ms per training step")
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    handles = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(handles.values(), handles.keys(), loc="upper center", ncol=len(handles), fontsize=9,
               bbox_to_anchor=(0.5, 0.955), frameon=False)
    measured = {"wall": "wall clock", "cpu": "CPU time of the training thread"}[clock]
    fig.suptitle(f"Training-step time by phase, {measured} (ratios: median of per-round ratios to "
                 f"unpatched)", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 2 rounds of 1 step, short warm-up, no separate memory phase")
    ap.add_argument("--rounds", type=int, help="rounds of turns (default 16, quick 2)")
    ap.add_argument("--steps", type=int, help="steps per contender per round (default 3, quick 1)")
    ap.add_argument("--memory-steps", type=int, default=3, help="steps measured in the memory phase")
    ap.add_argument("--observe-steps", type=int, default=3, help="fusion.observe_steps (default 3)")
    ap.add_argument("--measure-steps", type=int,
                    help="fusion.measure_steps for mode auto (default: the policy's, quick 32)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default observe steps + 3, quick + 1)")
    ap.add_argument("--chunk-bytes", default="auto", type=lambda v: v if v == "auto" else int(v),
                    help="fusion.chunk_bytes for the autopatch contenders (default auto)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per contender (default 1: on a shared machine a second "
                         "thread waits on busy cores and the timings turn to noise)")
    ap.add_argument("--clock", choices=CLOCKS, default="wall",
                    help="wall: perf_counter; cpu: the training thread's CPU time, which leaves out "
                         "time spent waiting for a core (one thread only)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    ap.add_argument("--plot", default=None,
                    help="PNG path ('' for none; default docs/fusion-modes.png, none with --quick, whose "
                         "smoke-sized figures must not replace the documented ones); needs the bench extra")
    args = ap.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 16)
    args.steps = args.steps or (1 if args.quick else 3)
    if args.warmup is None:
        args.warmup = args.observe_steps + (1 if args.quick else 3)
    if args.measure_steps is None and args.quick:
        args.measure_steps = 32
    keys = [k for k in args.workloads.split(",") if k]
    unknown = set(keys) - set(WORKLOADS)
    if unknown:
        ap.error(f"unknown workloads {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")

    started = time.perf_counter()
    ctx = multiprocessing.get_context("fork")
    print(f"# bench_fusion_modes: {summary()}")
    print(f"# chunk_bytes {args.chunk_bytes}")
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu measures the calling thread only: use it with --threads 1")
    print(f"# {args.threads} torch thread(s) per contender, {args.clock} clock, "
          f"rounds {args.rounds} x steps {args.steps}, "
          f"{args.warmup} warm-up steps (observe_steps {args.observe_steps}; auto: until it has "
          f"measured, measure_steps {args.measure_steps or 'default'})\n", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        procs = {}
        for key in keys:
            procs[key] = (run_workload(ctx, key, args, tmp),
                          {} if args.quick else run_workload(ctx, key, args, tmp, memory=True))
            print(f"  {key} done ({time.perf_counter() - started:.0f} s)", flush=True)
        # Tensor work in this process only now: no contender is forked after it.
        results = {key: summarise(key, *procs[key]) for key in keys}

    print()
    print(results_table(results))
    print("\nMode each autopatch contender ran, and why (autopatch.report()):")
    for key, (_, by_name) in results.items():
        for name in AUTOPATCH_MODES:
            print(f"- {key} / {name}: {by_name[name]['mode']}: {by_name[name]['reason']}")
    print("\nWhat mode auto measured during its warm-up (the report's auto section):")
    for key, (_, by_name) in results.items():
        a = by_name["auto"]["auto"]
        times = ", ".join(f"{m} {t:.2f}" for m, t in a["ms_per_step"].items()) if "ms_per_step" in a else a["why"]
        print(f"- {key}: {times} ms/step -> chose {a['chosen']} ({a.get('speedup_vs_off', 1.0):.2f}x "
              f"unpatched), {a['measure_steps']} steps / {a['measure_seconds']:.2f} s spent measuring "
              f"({a.get('rounds')} rounds of {a.get('window_steps')} steps)"
              + "".join(f"; not {m}: {why}" for m, why in a["ruled_out"].items()))
    print("\nTargets:")
    print(targets(results))
    if args.plot is None and not args.quick:
        args.plot = str(ROOT / "docs" / "fusion-modes.png")
    if args.plot:
        plot(results, args.plot, args.clock)
        print(f"\nPlot: {args.plot}")
    print(f"All autopatch contenders ended bit-for-bit equal to unpatched (model and optimizer state). "
          f"{closing(started).capitalize()}.")


if __name__ == "__main__":
    sys.exit(main())
