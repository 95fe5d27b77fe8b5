"""What autopatch's takeover of DDP's gradient sync costs per step, against DDP's own, on models so
small that the per-step cost of the sync, not its bytes, is what is measured.

N gloo ranks on 127.0.0.1 (2 and 4 by default) train one unchanged DDP script (``--worker``) for
``--steps`` steps; each contender is a job of its own, started zero-code:

- ``ddp``: torch's DistributedDataParallel, autopatch off (the baseline);
- ``intercept``: ``FUSEDOPT_ENABLE=1`` with ``allreduce.enabled: false``: autopatch's optimizer
  interception alone, DDP keeping its sync (what the runtime costs, apart from communication);
- ``gradient_allreduce``, ``bytegrad``, ``low_precision_decentralized``: ``FUSEDOPT_ENABLE=1
  FUSEDOPT_POLICY=<builtin policy> FUSEDOPT_MODE=off`` (no fusion, so only communication differs).

With ``--baseline DIR`` every autopatch contender runs a second time as ``<name> @baseline`` with
``PYTHONPATH=DIR`` (another checkout of autopatch, e.g. the commit before a change, in a git
worktree), so old and new are measured in the same rounds.

Models: ``tiny``, Bagua's module-test model (Linear(2, 10, bias=False), ReLU, Linear(10, 50),
ReLU, Linear(50, 4, bias=False), softmax; SGD lr 0.01; MSELoss on a fresh ``randn(4, 2)`` ->
``randn(4, 4)`` per step), and ``mlp``, a 4 x Linear(512, 512) ReLU stack with a 10-way head
(4.0 MiB of float32 gradients, batch 32, cross-entropy, SGD) where the sync's bytes matter.

Contenders alternate within one run, the first of each round rotating. Per job: rank 0's median
step after ``--warmup`` steps (and its mean, the job's time over its steps); per contender: the
median over rounds, and its ratio to ``ddp``, the median of per-round ratios. Every job also
hashes rank 0's final weights, to show which contenders trained exactly as DDP did.

    python benchmarks/bench_takeover.py                        # tiny and mlp, 2 and 4 ranks
    python benchmarks/bench_takeover.py --baseline ../old      # old and new in the same rounds
    python benchmarks/bench_takeover.py --profile gradient_allreduce --ranks 2   # cProfile rank 0
"""

import argparse
import hashlib
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import launch
from harness.alternation import turns
from harness.machine import closing, summary
from harness.report import markdown

ROOT = Path(__file__).resolve().parent.parent
ALGORITHMS = ("gradient_allreduce", "bytegrad", "low_precision_decentralized")
INTERCEPT_ONLY = "version: 1\nname: intercept\nfusion:\n  mode: off\nallreduce:\n  enabled: false\n"
TARGET = 1.10     # gradient_allreduce's step time over DDP's on the tiny model


# -- the unchanged training script -----------------------------------------------------------------
def build(model):
    """(module, batch maker, loss, optimizer maker) of ``model``."""
    import torch
    from torch import nn

    if model == "tiny":
        net = nn.Sequential(nn.Linear(2, 10, bias=False), nn.ReLU(), nn.Linear(10, 50), nn.ReLU(),
                            nn.Linear(50, 4, bias=False), nn.Softmax(dim=1))
        return (net, lambda g: (torch.randn(4, 2, generator=g), torch.randn(4, 4, generator=g)),
                nn.MSELoss(), lambda ps: torch.optim.SGD(ps, lr=0.01))
    from harness.workloads import stack
    net = stack(512, 4, head=10)
    return (net, lambda g: (torch.randn(32, 512, generator=g), torch.randint(0, 10, (32,), generator=g)),
            nn.CrossEntropyLoss(), lambda ps: torch.optim.SGD(ps, lr=0.01))


def worker(args):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    rank = launch.init_rank()
    torch.manual_seed(0)
    net, batch, loss_fn, make_opt = build(args.model)
    model = DDP(net)
    opt = make_opt(model.parameters())
    g = torch.Generator().manual_seed(rank)
    profile = None
    if args.profile_to and rank == 0:
        import cProfile
        profile = cProfile.Profile()
    marks = [time.perf_counter()]
    for step in range(args.steps):
        if step == args.warmup:
            cpu = time.process_time()
            if profile is not None:
                profile.enable()
        x, y = batch(g)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        marks.append(time.perf_counter())
    cpu = (time.process_time() - cpu) / (args.steps - args.warmup)
    if profile is not None:
        profile.disable()
        profile.dump_stats(args.profile_to)
    steps = [b - a for a, b in zip(marks[args.warmup:], marks[args.warmup + 1:])]
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    results = {"median": statistics.median(steps), "mean": statistics.mean(steps), "cpu": cpu,
               "weights": digest.hexdigest()}
    if rank == 0:
        import autopatch
        section = autopatch.report().get("allreduce", {}) if autopatch.is_enabled() else {}
        results["active"] = section.get("active")
    launch.save_results(results)
    dist.destroy_process_group()


# -- the launching side ----------------------------------------------------------------------------
def contenders(args, tmp):
    """name -> environment of its job (beyond the launcher's)."""
    intercept = tmp / "intercept.yaml"
    intercept.write_text(INTERCEPT_ONLY)
    autopatch = {"intercept": {"FUSEDOPT_ENABLE": 1, "FUSEDOPT_POLICY": intercept}}
    for name in ALGORITHMS:
        autopatch[name] = {"FUSEDOPT_ENABLE": 1, "FUSEDOPT_POLICY": name, "FUSEDOPT_MODE": "off"}
    chosen = args.contenders.split(",")
    out = {"ddp": {"PYTHONPATH": ROOT}} if "ddp" in chosen else {}
    for name, env in autopatch.items():
        if name in chosen:
            out[name] = dict(env, PYTHONPATH=ROOT)
            if args.baseline:
                out[f"{name} @baseline"] = dict(env, PYTHONPATH=Path(args.baseline).resolve())
    return out


def run_one(args, model, world, env, profile_to=None):
    """One job: rank 0's results, or why it failed."""
    argv = [__file__, "--worker", "--model", model, "--steps", args.steps_of[model], "--warmup", args.warmup]
    if profile_to:
        argv += ["--profile_to", profile_to]
    ranks = launch.run_ranks(argv, world, env=env, timeout=args.timeout)
    why = launch.failed(ranks)
    return (None, why) if why else (ranks[0].results, None)


def measure(args, model, world, jobs):
    """Every contender ``args.rounds`` times in turns: per contender, its results per round."""
    rounds = {name: [None] * args.rounds for name in jobs}
    for r, name in turns(dict(jobs), args.rounds):
        results, why = run_one(args, model, world, jobs[name])
        if why:
            print(f"{model} x{world} {name}: failed\n{why}", file=sys.stderr, flush=True)
            continue
        rounds[name][r] = results
        print(f"  {model} x{world} round {r + 1} {name}: {1e3 * results['median']:.3f} ms/step",
              file=sys.stderr, flush=True)
    return rounds


def table(model, rounds):
    ddp = rounds["ddp"]
    header = ["contender", "ms/step (median)", "mean ms/step", "vs ddp (median of rounds)",
              "over ddp, ms/step", "CPU ms/step", "weights = ddp's", "target"]
    rows = []
    for name, per_round in rounds.items():
        done = [(r, res) for r, res in enumerate(per_round) if res is not None and ddp[r] is not None]
        if not done:
            rows.append([name, "failed", "", "", "", "", "", ""])
            continue
        median = statistics.median(res["median"] for _, res in done)
        mean = statistics.median(res["mean"] for _, res in done)
        ratio = statistics.median(res["median"] / ddp[r]["median"] for r, res in done)
        over = statistics.median(res["median"] - ddp[r]["median"] for r, res in done)
        cpu = statistics.median(res["cpu"] for _, res in done)
        same = all(res["weights"] == ddp[r]["weights"] for r, res in done)
        target = ""
        if model == "tiny" and name.startswith("gradient_allreduce"):
            target = f"<= {TARGET:.2f}x {'met' if ratio <= TARGET else 'NOT met'}"
        rows.append([name, f"{1e3 * median:.3f}", f"{1e3 * mean:.3f}", f"{ratio:.3f}x", f"{1e3 * over:+.3f}",
                     f"{1e3 * cpu:.3f}",
                     "yes" if same else "no", target])
    return markdown(header, rows)


def profile(args, tmp):
    """One job of ``--profile`` per world size, cProfile in rank 0 after warm-up: the top entries."""
    import pstats
    env = contenders(args, tmp)[args.profile]
    for world in map(int, args.ranks.split(",")):
        for model in args.models.split(","):
            out = tmp / f"{model}-{world}.prof"
            _, why = run_one(args, model, world, env, out)
            if why:
                print(f"{model} x{world}: failed\n{why}")
                continue
            text = io.StringIO()
            stats = pstats.Stats(str(out), stream=text)
            stats.sort_stats("tottime").print_stats(args.profile_lines)
            stats.sort_stats("cumulative").print_stats(args.profile_lines)
            print(f"## {args.profile}, {model}, {world} ranks, rank 0, steps after warm-up\n\n```\n{text.getvalue()}```\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,mlp")
    ap.add_argument("--ranks", default="2,4", help="comma-separated world sizes")
    ap.add_argument("--contenders", default="ddp,intercept," + ",".join(ALGORITHMS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1000, help="steps per job of the tiny model")
    ap.add_argument("--mlp_steps", type=int, default=200, help="steps per job of the mlp")
    ap.add_argument("--warmup", type=int, default=20, help="steps not timed at the start of each job")
    ap.add_argument("--baseline", help="another autopatch checkout, run as '<name> @baseline'")
    ap.add_argument("--profile", help="a contender to profile (rank 0, cProfile) instead of measuring")
    ap.add_argument("--profile_lines", type=int, default=30)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per job, all ranks together")
    ap.add_argument("--quick", action="store_true", help="1 round of 200 tiny steps, 2 ranks: a smoke run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--profile_to", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.rounds, args.steps, args.mlp_steps, args.ranks = 1, 200, 50, "2"
    args.steps_of = {"tiny": args.steps, "mlp": args.mlp_steps}
    started = time.perf_counter()
    print(f"# {summary()}")
    print(f"# {' '.join(sys.argv)}\n")
    status = 0
    with tempfile.TemporaryDirectory() as tmp:
        if args.profile:
            return profile(args, Path(tmp))
        jobs = contenders(args, Path(tmp))
        for model in args.models.split(","):
            for world in map(int, args.ranks.split(",")):
                rounds = measure(args, model, world, jobs)
                status |= any(res is None for per_round in rounds.values() for res in per_round)
                print(f"## {model}, {world} ranks, {args.steps_of[model]} steps per job "
                      f"({args.warmup} not timed), {args.rounds} rounds\n")
                print(table(model, rounds) + "\n", flush=True)
    print(closing(started))
    return status


if __name__ == "__main__":
    sys.exit(main())
