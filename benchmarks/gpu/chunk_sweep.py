"""``bench_gpu.py --chunk-sweep``: ``multi_layer`` and ``backward`` timed over chunk sizes, on the
workloads whose step the chunk size moves most."""

import time

import torch

from harness.gpu_contenders import UNPATCHED, fusion_mode
from harness.gpu_report import Output, environment, figures, method_line, table
from harness.gpu_runs import measure
from harness.gpu_workloads import MiB
from harness.report import log

SWEEP_WORKLOADS = ("gpt2-b8-adamw", "gpt2-b8-bertadam", "mobilenet-b32-sgd")
SWEEP_MIB = (1, 4, 16, 64, 256)


def run_chunk_sweep(ctx, args, opts, info, tmp):
    out = Output(args.out, "chunk-sweep")
    measured, text = {}, ""
    for key in SWEEP_WORKLOADS:
        for m in ("multi_layer", "backward"):
            t0 = time.perf_counter()
            contenders = [UNPATCHED] + [fusion_mode(m, f"{m}@{n}MiB", f"{m}, {n} MiB chunks", chunk_bytes=n * MiB)
                                        for n in SWEEP_MIB]
            measured[f"{key} {m}"] = measure(ctx, key, contenders, opts)
            log(f"  {key} / {m} done in {time.perf_counter() - t0:.0f} s")
            text = "\n\n".join([
                f"# Chunk-size sweep ({args.device})", environment(info, args, method_line(opts, checked=False)),
                table(f"multi_layer and backward over chunk sizes {', '.join(f'{n} MiB' for n in SWEEP_MIB)}",
                      measured, torch.device(args.device), sync=False)])
            out.write(text, {"info": info, "opts": opts, "measured": measured,
                             "figures": {k: figures(v) for k, v in measured.items()}})
    return text, 0
