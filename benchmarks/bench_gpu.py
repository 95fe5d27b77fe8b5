"""The GPU table: step time, optimizer time and peak memory of autopatch's modes and torch's optimizers.

Measured on CUDA, on MobileNetV2, GPT-2 124M and a 400-tensor MLP.

Contenders: unpatched with torch's default implementation (foreach on CUDA), a second unpatched
process (the noise floor: what two identical processes differ by), unpatched ``foreach=False``,
unpatched ``fused=True`` (AdamW and SGD only), autopatch ``multi_layer``, ``backward``,
``forward`` and ``auto``, and the builtin policy ``fast`` (mode auto, and forced to
``multi_layer`` and ``backward``; the notes give each optimizer's route, probe deviation and
compile time). A contender whose policy or option the autopatch under test does not know
(``autopatch.PolicyError``) is skipped with a note.

Method. Each contender trains in a process of its own (global hooks of one mode can never slow
another, and each process's peak memory is its own), all started once per workload from a fork
server that imported torch but never touched CUDA. They warm up one at a time, for at least
``--warmup`` steps and until ``autopatch.report()`` has shown the same mode and reason for 5 steps
(the modes that watch the first steps have decided), then take turns, round by round, the
starting one rotating. In its turn a process runs one untimed step (its allocator refills), then
``--steps`` timed steps, then hands its cached GPU memory back (``torch.cuda.empty_cache``), so
the idle contenders leave the active one the whole device. A step is ``zero_grad(); loss =
f(model(x)); loss.backward(); opt.step()``: whole-step time between two
``torch.cuda.synchronize()``, optimizer time between CUDA events around ``opt.step()`` (no extra
sync, so the step is timed as it runs). Mode ``backward`` updates inside backward and ``forward``
inside the next forward: their optimizer column shrinks by design and only the whole step
compares. Figures are medians over all timed steps; ratios are the median of per-round ratios
against unpatched (launch-bound runs drift by +-15% between processes and over time; the second
unpatched process shows how much of a ratio that drift can explain). Peak memory is
``torch.cuda.max_memory_allocated()`` over the timed steps (reset after each turn's untimed step),
the largest over all turns.

Checks. Training results: every contender trains ``--check-steps`` steps from the same seed in a
fresh process under ``torch.use_deterministic_algorithms(True)``, and its model and optimizer
state are compared with unpatched's: bit for bit, or the largest weight difference (``fused=True``
and the ``fast`` contenders are expected to differ by float rounding; the exact modes must not differ at all, and
the script exits 1 if one does). No host-device sync: after timing, each contender runs two
steady-state steps under ``torch.cuda.set_sync_debug_mode("error")``; a synchronising call fails
the check with torch's message and where it was made.

Extra runs: ``--max-model`` bisects the layer count of a GPT-2-style model (width 3072, 24 heads,
AdamW, fp32 weights, bf16 autocast, batch 1 x 256, 6 steps) that trains without running out of
memory, each try in a fresh process; ``--chunk-sweep`` times ``multi_layer`` and ``backward`` over
chunk sizes; ``--fsdp`` times a 1-rank FSDP2 (``fully_shard``) GPT-2, unpatched against autopatch's
default policy. ``--device cpu`` runs everything on small shapes, to exercise the harness where
there is no GPU (peak memory is then the process's peak resident set; the sync check is CUDA-only;
``--max-model`` caps the process's data segment to stand in for the device's capacity).

Results go to ``--out`` as Markdown (one table per run) and JSON (every raw figure), written after
each workload so a run cut short keeps what it measured, and the Markdown is printed at the end.

    PYTHONPATH=$PWD python benchmarks/bench_gpu.py --out DIR --workloads mobilenet
    PYTHONPATH=$PWD python benchmarks/bench_gpu.py --out DIR --workloads gpt2,mlp
    PYTHONPATH=$PWD python benchmarks/bench_gpu.py --out DIR --max-model --fsdp
    PYTHONPATH=$PWD python benchmarks/bench_gpu.py --out DIR --chunk-sweep
    PYTHONPATH=$PWD python benchmarks/bench_gpu.py --device cpu --quick --out DIR   # harness smoke run
"""

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpu.chunk_sweep import run_chunk_sweep
from gpu.fsdp import run_fsdp
from gpu.max_model import run_max_model
from gpu.table import TABLE, run_table
from harness.gpu_job import info_worker
from harness.gpu_workloads import TORCHVISION, TRANSFORMERS, WORKLOADS
from harness.machine import autopatch_source
from harness.processes import Worker
from harness.report import log

HARNESS_MODULES = ("alternation", "fsdp", "gpu_contenders", "gpu_job", "gpu_report", "gpu_runs", "gpu_workloads",
                   "machine", "memory", "optimizers", "processes", "report", "states", "workloads")
RUN_MODULES = ("chunk_sweep", "fsdp", "max_model", "table")


def select_workloads(spec, ap):
    keys = []
    for token in (t for t in spec.split(",") if t):
        match = [k for k in WORKLOADS if k == token or k.startswith(token + "-")]
        if not match:
            ap.error(f"unknown workload {token!r}; choose from {', '.join(WORKLOADS)} "
                     "or a prefix (mobilenet, gpt2, mlp)")
        keys += [k for k in match if k not in keys]
    return keys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default; without CUDA the script says so and exits 0) or cpu: small shapes")
    ap.add_argument("--out", help="directory for the Markdown and JSON results (required when there is a GPU "
                                  "or with --device cpu)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 rounds x 2 steps, short warm-up and check")
    ap.add_argument("--workloads", default="mobilenet,gpt2,mlp",
                    help="comma-separated workloads or prefixes: " + ", ".join(WORKLOADS))
    ap.add_argument("--contenders", default=",".join(c.name for c in TABLE),
                    help="comma-separated subset of the table's contenders (unpatched is always in)")
    ap.add_argument("--rounds", type=int, help="rounds of turns (default 10, quick 2)")
    ap.add_argument("--steps", type=int, help="timed steps per contender per round (default 8, quick 2)")
    ap.add_argument("--warmup", type=int, help="warm-up steps at least (default 15, quick 6)")
    ap.add_argument("--check-steps", type=int, help="deterministic steps of the training-result check "
                                                    "(default 8, quick 6: past autopatch's 3 watched steps)")
    ap.add_argument("--max-model", action="store_true", help="bisect the largest GPT-2-style model per mode")
    ap.add_argument("--max-model-layers", type=int, nargs=2, default=(1, 48), metavar=("LO", "HI"),
                    help="layer range of the bisection (default 1 48)")
    ap.add_argument("--chunk-sweep", action="store_true", help="multi_layer and backward over chunk sizes")
    ap.add_argument("--fsdp", action="store_true", help="1-rank FSDP2 GPT-2, unpatched vs autopatch default")
    ap.add_argument("--table", action="store_true", help="the main table (the default when no other run is named)")
    args = ap.parse_args()
    args.keys = select_workloads(args.workloads, ap)
    args.contenders = {"unpatched"} | set(args.contenders.split(","))
    unknown = args.contenders - {c.name for c in TABLE}
    if unknown:
        ap.error(f"unknown contenders {sorted(unknown)}; choose from {', '.join(c.name for c in TABLE)}")
    args.tag = "all" if args.workloads == ap.get_default("workloads") else "-".join(
        t for t in args.workloads.split(",") if t)
    if not (args.max_model or args.chunk_sweep or args.fsdp):
        args.table = True

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"CUDA is not available (torch {torch.__version__}, built for CUDA {torch.version.cuda}): "
              f"nothing to measure. `--device cpu` runs the harness on small shapes.")
        return 0
    if args.out is None:
        ap.error("--out DIR is required")
    cuda = args.device == "cuda"
    opts = {"device": args.device,
            "rounds": args.rounds or (2 if args.quick else 10),
            "steps": args.steps or (2 if args.quick else 8),
            "warmup": args.warmup if args.warmup is not None else (6 if args.quick else 15),
            "check_steps": args.check_steps or (6 if args.quick else 8),
            "parallel_checks": 4 if cuda else 2, "sync_check": True,
            "timeout": 300 if cuda else 900}
    ignored = sorted(k for k in os.environ if k.startswith("FUSEDOPT_"))
    for k in ignored:      # every contender names its own policy; nothing from the environment
        del os.environ[k]
    ctx = multiprocessing.get_context("forkserver")
    # Imported once in the fork server, so each contender starts in milliseconds. Named one by one:
    # the server does not import the main script itself.
    ctx.set_forkserver_preload(["torch", "autopatch"] + [f"harness.{m}" for m in HARNESS_MODULES]
                               + [f"gpu.{m}" for m in RUN_MODULES]
                               + ([] if TRANSFORMERS else ["transformers.models.gpt2.modeling_gpt2"])
                               + ([] if TORCHVISION else ["torchvision.models"]))
    started = time.perf_counter()
    w = Worker(ctx, info_worker, args.device, timeout=opts["timeout"])
    info = w.answer()
    w.close()
    log(f"# bench_gpu on {info['device']}, torch {info['torch']} (CUDA {info['cuda']}); {autopatch_source()}"
        + (f"; ignoring {', '.join(ignored)}" if ignored else ""))
    runs = [(flag, fn) for flag, fn in ((args.table, run_table), (args.max_model, run_max_model),
                                        (args.chunk_sweep, run_chunk_sweep), (args.fsdp, run_fsdp)) if flag]
    texts, status = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for _, fn in runs:
            text, rc = fn(ctx, args, opts, info, tmp)
            texts.append(text)
            status = max(status, rc)
    print("\n\n".join(texts))
    log(f"\nResults in {Path(args.out).resolve()}; total {time.perf_counter() - started:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
