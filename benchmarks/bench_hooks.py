"""CPU time that backward fusion's gradient hooks add to a backward pass, per parameter.

Backward fusion hooks every fused parameter's gradient (``register_post_accumulate_grad_hook``)
and counts chunks down. On an accelerator the backward pass is mostly the host launching kernels,
so the Python run per hook adds to every step of a launch-bound job. This measures it on the CPU,
where the same Python runs: a model of many small parameters whose backward is cheap, and the
thread CPU time of ``loss.backward()`` for

- ``unpatched``: no hook;
- ``empty hook``: a Python post-accumulate-grad hook that does nothing (the floor: what torch
  itself charges for calling any Python hook);
- ``backward``: autopatch mode backward (the hooks, plus updating its few chunks with SGD; the
  update is timed separately through the report and is a small part).

Each contender is a process of its own (autopatch's hooks are global to a process), taking turns
over rounds; per round the difference to unpatched is divided by the number of parameters, and the
medians over rounds are quoted. Run it against another checkout of autopatch by putting that
checkout first on ``PYTHONPATH``: that is how a before/after comparison is made.

    python benchmarks/bench_hooks.py                 # about 30 s
"""

import argparse
import multiprocessing
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_context import autopatch_revision, cpu_model, load_average, markdown  # noqa: E402

CONTENDERS = ("unpatched", "empty hook", "backward")


def build(n_params, size):
    torch.manual_seed(0)
    params = nn.ParameterList(nn.Parameter(torch.randn(size)) for _ in range(n_params))
    return params, torch.randn(size)


def worker(conn, contender, args):
    try:
        torch.set_num_threads(1)
        import autopatch
        params, x = build(args.params, args.size)
        if contender == "backward":
            autopatch.enable(mode="backward", fusion={"observe_steps": 1})
        elif contender == "empty hook":
            for p in params:
                p.register_post_accumulate_grad_hook(lambda p: None)
        opt = torch.optim.SGD(params, lr=1e-3)

        def step(times):
            opt.zero_grad()
            loss = sum((p * x).sum() for p in params)
            t0 = time.thread_time()
            loss.backward()
            times.append(time.thread_time() - t0)
            opt.step()
        for _ in range(args.warmup):
            step([])
        conn.send("ready")
        while True:
            cmd = conn.recv()
            if cmd == "done":
                rep = autopatch.report()["optimizers"] if contender == "backward" else []
                conn.send({"mode": rep[0]["mode"] if rep else None,
                           "in_backward": rep[0].get("fusion", {}).get("chunk_updates_in_backward") if rep else None})
                return
            times = []
            for _ in range(cmd):
                step(times)
            conn.send(times)
    except BaseException:
        conn.send({"error": traceback.format_exc()})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=1000, help="number of parameters (default 1000)")
    ap.add_argument("--size", type=int, default=64, help="elements per parameter (default 64)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=5, help="backward passes per contender per round")
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()

    ctx = multiprocessing.get_context("fork")
    procs = {}
    for name in CONTENDERS:
        conn, child = ctx.Pipe()
        ctx.Process(target=worker, args=(child, name, args), daemon=True).start()
        procs[name] = conn
    for name, conn in procs.items():
        msg = conn.recv()
        if msg != "ready":
            sys.exit(f"{name} failed:\n{msg['error']}")
    load0 = load_average()
    per_round = {name: [] for name in CONTENDERS}
    for r in range(args.rounds):
        order = CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[:r % len(CONTENDERS)]
        for name in order:
            procs[name].send(args.steps)
            per_round[name].append(statistics.median(procs[name].recv()))
    info = {}
    for name, conn in procs.items():
        conn.send("done")
        info[name] = conn.recv()
    if info["backward"]["mode"] != "backward":
        sys.exit(f"autopatch ran mode {info['backward']['mode']}, not backward")

    base = per_round["unpatched"]
    rows = []
    for name in CONTENDERS:
        med = statistics.median(per_round[name])
        extra = [(a - b) / args.params * 1e6 for a, b in zip(per_round[name], base)]
        rows.append([name, f"{med * 1e3:.2f}", "" if name == "unpatched" else f"{statistics.median(extra):.2f}"])
    print(f"autopatch {autopatch_revision()}, torch {torch.__version__}, {cpu_model()}, "
          f"load average {load0} -> {load_average()}")
    print(f"{args.params} parameters of {args.size} elements, SGD, 1 thread; {args.rounds} rounds x "
          f"{args.steps} backward passes; chunk updates inside backward per step: "
          f"{info['backward']['in_backward'] / ((args.rounds * args.steps + args.warmup) or 1):.1f}\n")
    print(markdown(["contender", "backward CPU ms (median)", "added CPU us per parameter (median)"], rows))


if __name__ == "__main__":
    main()
