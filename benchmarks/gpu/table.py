"""The GPU table: every contender on every workload chosen, whole step, optimizer step and peak
memory, each contender's training result checked against unpatched's and its steps checked for
host-device syncs (``bench_gpu.py``, the default run)."""

import time

import torch

from harness.gpu_contenders import EXACT_MODES, UNPATCHED, Contender, fusion_mode
from harness.gpu_report import Output, environment, figures, method_line, notes, table
from harness.gpu_runs import check, measure
from harness.report import log

TABLE = [UNPATCHED,
         Contender("twin", "unpatched, second process (noise)"),
         Contender("foreach_off", "unpatched foreach=False", options=(("foreach", False),)),
         Contender("fused", "unpatched fused=True", options=(("fused", True),)),
         *[fusion_mode(m) for m in EXACT_MODES],
         Contender("fast", "autopatch policy fast (within rounding)", "fast"),
         Contender("fast_multi_layer", "autopatch fast, multi_layer", "fast", (("mode", "multi_layer"),)),
         Contender("fast_backward", "autopatch fast, backward", "fast", (("mode", "backward"),))]


def run_table(ctx, args, opts, info, tmp):
    keys, contenders = args.keys, [c for c in TABLE if c.name in args.contenders]
    out = Output(args.out, f"table-{args.tag}")
    measured, checks, started = {}, {}, time.perf_counter()
    text = ""
    for key in keys:
        t0 = time.perf_counter()
        checks[key] = check(ctx, key, contenders, opts, tmp)
        log(f"  {key} checked in {time.perf_counter() - t0:.0f} s")
        measured[key] = measure(ctx, key, contenders, opts)
        log(f"  {key} done in {time.perf_counter() - t0:.0f} s (total {time.perf_counter() - started:.0f} s)")
        lines, broken = notes(measured, checks)
        text = "\n\n".join([
            f"# GPU table ({args.device})", environment(info, args, method_line(opts)),
            table("Whole step, optimizer step, peak memory", measured, torch.device(args.device), checks,
                  sync=True),
            "Mode each contender ran and why (autopatch.report()), and contenders left out:\n\n" + "\n".join(lines),
            ("**Not bit-for-bit equal to unpatched: " + ", ".join(broken) + "**") if broken else
            "Every exact contender (multi_layer, backward, forward, auto, the second unpatched process) "
            "that was checked trained bit for bit like unpatched."])
        out.write(text, {"info": info, "opts": opts, "measured": measured, "checks": checks,
                         "figures": {k: figures(v) for k, v in measured.items()}})
    return text, 1 if notes(measured, checks)[1] else 0
