"""DDP's own allreduce against autopatch's bucketed allreduce, side by side in one run.

Two gloo processes on 127.0.0.1 train the same MLP under each contender in turn: DDP with its
default buckets, DDP with other ``bucket_cap_mb`` values (the best of them is "DDP tuned"),
autopatch at several bucket sizes, and autopatch with each compression. Rounds rotate the order
of the contenders; each block runs warm-up steps, then timed steps; medians over all timed steps.

Reported per contender: step time, exposed communication (step time minus the step time of the
same job under ``no_sync()``, which sends nothing), autopatch's own time waiting on collectives,
and bytes sent per step per rank, measured from ``/proc/self/io`` (Linux counts socket writes in
``wchar``; nothing else writes during the timed steps).

    python benchmarks/bench_allreduce.py             # a few minutes on 2 cores
    python benchmarks/bench_allreduce.py --quick     # smoke run
"""

import argparse
import contextlib
import os
import statistics
import sys
import time

from harness import launch
from harness.alternation import turns

MiB = 2**20


def contenders(quick):
    ddp_caps = (1, 4) if quick else (1, 4, 8, 64)
    sizes = (1, 25) if quick else (1, 4, 8, 25, 64)
    out = [("no_sync (compute only)", "no_sync", None), ("DDP default (25 MB)", "ddp", None)]
    out += [(f"DDP bucket_cap_mb={c}", "ddp", c) for c in ddp_caps]
    out += [(f"autopatch {s} MiB", "autopatch", {"bucket_bytes": s * MiB}) for s in sizes]
    out += [(f"autopatch 25 MiB {c}", "autopatch", {"bucket_bytes": 25 * MiB, "compression": c})
            for c in ("fp16", "bf16", "minmax_uint8")]
    out += [(f"autopatch 1 MiB + {mode}", "autopatch", {"bucket_bytes": 1 * MiB, "mode": mode})
            for mode in ("multi_layer", "backward")]
    return out


def wchar():
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def worker(args):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import autopatch
    from harness.workloads import stack

    torch.set_num_threads(1)
    rank = launch.init_rank()

    def build():
        torch.manual_seed(0)
        return stack(args.width, args.depth, head=10)

    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    runs = contenders(args.quick)
    models = {}
    for name, kind, arg in runs:
        if kind == "ddp":
            models[name] = DDP(build(), bucket_cap_mb=arg) if arg else DDP(build())
    shared = DDP(build())            # no_sync and every autopatch contender train this one
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for name, m in models.items()}
    opts["shared"] = torch.optim.SGD(shared.parameters(), lr=1e-3, momentum=0.9)

    def step(model, opt, sync):
        opt.zero_grad()
        with contextlib.nullcontext() if sync else model.no_sync():
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    times = {name: [] for name, _, _ in runs}
    waits = {name: [] for name, _, _ in runs}
    sent = {name: [] for name, _, _ in runs}
    for _, (name, kind, arg) in turns(runs, args.rounds):
        warmup = args.warmup
        if kind == "autopatch":
            settings = dict(arg)
            mode = settings.pop("mode", "off")
            autopatch.enable(mode=mode, fusion={"observe_steps": 1}, allreduce=dict({"enabled": True}, **settings))
            warmup += 2 if mode != "off" else 0   # backward starts after 1 watched step
        model = models.get(name, shared)
        opt = opts.get(name, opts["shared"])
        try:
            for _ in range(warmup):
                step(model, opt, kind != "no_sync")
            dist.barrier()
            wait0 = autopatch.report()["allreduce"].get("wait_seconds", 0.0) if kind == "autopatch" else 0.0
            for _ in range(args.steps):
                b0, t0 = wchar(), time.perf_counter()
                step(model, opt, kind != "no_sync")
                times[name].append(time.perf_counter() - t0)
                sent[name].append(wchar() - b0)
            if kind == "autopatch":
                report = autopatch.report()
                waits[name].append((report["allreduce"]["wait_seconds"] - wait0) / args.steps)
                ran = {o["mode"] for o in report["optimizers"] if o["steps"]}
                if ran != {mode}:
                    raise SystemExit(f"{name}: the optimizer ran in mode {ran}, not {mode}")
        finally:
            if kind == "autopatch":
                autopatch.disable()
    if rank == 0:
        base = statistics.median(times["no_sync (compute only)"])
        rows = []
        for name, kind, _ in runs:
            t = statistics.median(times[name])
            rows.append({"contender": name, "step_ms": 1e3 * t, "min_ms": 1e3 * min(times[name]),
                         "exposed_comm_ms": 1e3 * (t - base),
                         "wait_ms": 1e3 * statistics.median(waits[name]) if waits[name] else None,
                         "sent_mib": statistics.median(sent[name]) / MiB})
        launch.save_results(rows)
    sys.stdout.flush()
    os._exit(0)


def table(rows, params):
    ddp_default = next(r for r in rows if r["contender"].startswith("DDP default"))["step_ms"]
    ddp_tuned = min((r for r in rows if r["contender"].startswith("DDP")), key=lambda r: r["step_ms"])
    plain = [r for r in rows if r["contender"].startswith("autopatch") and r["contender"].endswith("MiB")]
    fused = [r for r in rows if " + " in r["contender"]]
    best = min(plain, key=lambda r: r["step_ms"])
    uncompressed = next(r for r in rows if r["contender"] == "autopatch 25 MiB")["sent_mib"]
    lines = [f"model: {params / 1e6:.2f} M parameters ({params * 4 / MiB:.1f} MiB of float32 gradients)", "",
             "| contender | step, median (ms) | step, min (ms) | exposed comm (ms) | autopatch wait (ms) "
             "| sent per step (MiB) | median vs DDP default |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        wait = "" if r["wait_ms"] is None else f"{r['wait_ms']:.1f}"
        lines.append(f"| {r['contender']} | {r['step_ms']:.1f} | {r['min_ms']:.1f} | {r['exposed_comm_ms']:.1f} | {wait} | "
                     f"{r['sent_mib']:.2f} | {r['step_ms'] / ddp_default:.3f} |")
    lines += ["", f"DDP tuned: {ddp_tuned['contender']} ({ddp_tuned['step_ms']:.1f} ms)",
              f"best autopatch bucket size: {best['contender']}, ratio to DDP default "
              f"{best['step_ms'] / ddp_default:.3f}, to DDP tuned {best['step_ms'] / ddp_tuned['step_ms']:.3f}"]
    for c in ("fp16", "bf16", "minmax_uint8"):
        r = next(r for r in rows if r["contender"].endswith(c))
        lines.append(f"{c}: bytes sent cut {uncompressed / r['sent_mib']:.2f}x, step time "
                     f"{r['step_ms'] / ddp_default:.3f} of DDP default")
    for r in fused:
        lines.append(f"{r['contender']}: step time {r['step_ms'] / ddp_default:.3f} of DDP default, "
                     f"{r['step_ms'] / best['step_ms']:.3f} of the best allreduce-only bucket size")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a small model, few rounds: a smoke run")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds for the whole run of both ranks")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.width, args.depth, args.rounds, args.steps = 256, 4, 2, 3
    if args.worker:
        return worker(args)
    ranks = launch.run_ranks([__file__, *sys.argv[1:], "--worker"], 2, timeout=args.timeout)
    why = launch.failed(ranks)
    if why:
        sys.exit(f"a rank failed:\n{why}")
    rows = ranks[0].results
    params = (args.depth * (args.width + 1) * args.width) + (args.width + 1) * 10
    print(table(rows, params))


if __name__ == "__main__":
    main()
