"""What autopatch's takeover of DDP's gradient sync costs per step, against DDP's own, on models so
small that the per-step cost of the sync, not its bytes, is what is measured.

N gloo ranks on 127.0.0.1 (2 and 4 by default) train one unchanged DDP script (``--worker``); each
contender is a job of its own, started zero-code:

- ``ddp``: torch's DistributedDataParallel, autopatch off (the baseline);
- ``default``: ``FUSEDOPT_ENABLE=1`` and nothing else, as a user starts it (the default policy:
  mode auto, and DDP's gradient sync wherever nothing asks for autopatch's); target: within 2% of
  ``ddp``;
- ``intercept``: ``FUSEDOPT_ENABLE=1`` with ``fusion.mode: off`` and ``allreduce.enabled: false``:
  autopatch's optimizer interception alone, DDP keeping its sync (what the runtime costs, apart
  from communication);
- ``off``, ``multi_layer``, ``forward``: the default policy with that mode named
  (``FUSEDOPT_MODE``), to set what auto chose against its choice named from the start;
- ``no_breakdown``: the default policy without the report's per-step breakdown
  (``FUSEDOPT_BREAKDOWN=0``), to show what the breakdown's clocks cost a step;
- ``gradient_allreduce``, ``bytegrad``, ``low_precision_decentralized``: ``FUSEDOPT_ENABLE=1
  FUSEDOPT_POLICY=<builtin policy> FUSEDOPT_MODE=off`` (no fusion, so only communication differs);
- ``gradient_allreduce_1mib``: the same with 1 MiB buckets (the mlp's gradients in several
  buckets, so later buckets wait for the first one's layout check).

With ``--baseline DIR`` every autopatch contender runs a second time as ``<name> @baseline`` with
``PYTHONPATH=DIR`` (another checkout of autopatch, e.g. the commit before a change, in a git
worktree), so old and new are measured in the same rounds.

Models: ``tiny``, Bagua's module-test model (Linear(2, 10, bias=False), ReLU, Linear(10, 50),
ReLU, Linear(50, 4, bias=False), softmax; SGD lr 0.01; MSELoss on a fresh ``randn(4, 2)`` ->
``randn(4, 4)`` per step), and ``mlp``, a 4 x Linear(512, 512) ReLU stack with a 10-way head
(4.0 MiB of float32 gradients, batch 32, cross-entropy, SGD) where the sync's bytes matter.

Every contender's job starts once, runs ``--warmup`` steps, and then the jobs take turns
(``harness/relay.py``): round after round, the first of each round rotating, each job runs a block
of ``--block`` steps (``--mlp_block`` for the mlp) while the others wait, so load from other work
on this shared machine falls on every contender alike and no start-up is timed. Per block: rank 0's
median step, its mean step and its CPU time per step (its main thread's, which runs the training
step, and the process's, gloo's threads included);
per contender: the medians over rounds, and its ratio to ``ddp``, the median of per-round ratios
(both blocks measured within a second or so of each other). Every job hashes rank 0's final
weights, to show which contenders trained exactly as DDP did (every job trains the same steps on
the same batches), and says the fusion mode rank 0's optimizer ended in (auto's choice).

    python benchmarks/bench_takeover.py                        # tiny and mlp, 2 and 4 ranks
    python benchmarks/bench_takeover.py --baseline ../old      # old and new in the same rounds
    python benchmarks/bench_takeover.py --profile gradient_allreduce --ranks 2   # cProfile rank 0
    python benchmarks/bench_takeover.py --quick                # smoke run
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
from harness.relay import Baton, Relay
from harness.report import markdown

ROOT = Path(__file__).resolve().parent.parent
ALGORITHMS = ("gradient_allreduce", "bytegrad", "low_precision_decentralized")
NAMED_MODES = ("off", "multi_layer", "forward")
INTERCEPT_ONLY = "version: 1\nname: intercept\nfusion:\n  mode: off\nallreduce:\n  enabled: false\n"
SMALL_BUCKETS = "version: 1\nname: small-buckets\nallreduce:\n  enabled: true\n  bucket_bytes: 1MiB\n"
TARGET = 1.10     # gradient_allreduce's step time over DDP's on the tiny model
DEFAULT_TARGET = 1.02   # the default policy's step time over DDP's, every model


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
    rank = launch.init_rank(timeout=args.timeout)
    torch.manual_seed(0)
    net, batch, loss_fn, make_opt = build(args.model)
    model = DDP(net)
    opt = make_opt(model.parameters())
    g = torch.Generator().manual_seed(rank)

    def steps(n):
        """Train ``n`` steps: the median and mean step, and CPU seconds per step (this thread's,
        which runs forward, backward and the step, and the process's, gloo's threads included)."""
        marks, cpu, thread = [time.perf_counter()], time.process_time(), time.thread_time()
        for _ in range(n):
            x, y = batch(g)
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            marks.append(time.perf_counter())
        times = [b - a for a, b in zip(marks, marks[1:])]
        return {"median": statistics.median(times), "mean": statistics.mean(times),
                "cpu": (time.process_time() - cpu) / n, "thread": (time.thread_time() - thread) / n}

    steps(args.warmup)
    if args.profile_to:
        profiled(steps, args.steps, args.profile_to if rank == 0 else None)
    else:
        baton = Baton()
        while (n := baton.next()) is not None:
            baton.answer(steps(n))
        digest = hashlib.sha256()
        for p in model.parameters():
            digest.update(p.detach().numpy().tobytes())
        baton.answer({"weights": digest.hexdigest(), "mode": mode_in_effect()})
    dist.destroy_process_group()


def mode_in_effect():
    """The fusion mode autopatch runs the optimizer in at the end (auto's choice), or '-' unpatched."""
    import autopatch
    if not autopatch.is_enabled():
        return "-"
    optimizers = autopatch.report()["optimizers"]
    return optimizers[0]["mode"] if optimizers else "-"


def profiled(steps, n, to):
    """Run ``n`` steps, under cProfile where ``to`` (a path) is given."""
    if to is None:
        return steps(n)
    import cProfile
    profile = cProfile.Profile()
    profile.runcall(steps, n)
    profile.dump_stats(to)


# -- the launching side ----------------------------------------------------------------------------
def contenders(args, tmp):
    """name -> environment of its job (beyond the launcher's)."""
    intercept = tmp / "intercept.yaml"
    intercept.write_text(INTERCEPT_ONLY)
    autopatch = {"default": {"FUSEDOPT_ENABLE": 1},
                 "intercept": {"FUSEDOPT_ENABLE": 1, "FUSEDOPT_POLICY": intercept}}
    for mode in NAMED_MODES:
        autopatch[mode] = {"FUSEDOPT_ENABLE": 1, "FUSEDOPT_MODE": mode}
    autopatch["no_breakdown"] = {"FUSEDOPT_ENABLE": 1, "FUSEDOPT_BREAKDOWN": 0}
    for name in ALGORITHMS:
        autopatch[name] = {"FUSEDOPT_ENABLE": 1, "FUSEDOPT_POLICY": name, "FUSEDOPT_MODE": "off"}
    small = tmp / "small-buckets.yaml"
    small.write_text(SMALL_BUCKETS)
    autopatch["gradient_allreduce_1mib"] = dict(autopatch["gradient_allreduce"], FUSEDOPT_POLICY=small)
    chosen = args.contenders.split(",")
    out = {"ddp": {"PYTHONPATH": ROOT}} if "ddp" in chosen else {}
    for name, env in autopatch.items():
        if name in chosen:
            out[name] = dict(env, PYTHONPATH=ROOT)
            if args.baseline:
                out[f"{name} @baseline"] = dict(env, PYTHONPATH=Path(args.baseline).resolve())
    return out


def worker_argv(args, model, profile_to=None):
    argv = [__file__, "--worker", "--model", model, "--warmup", args.warmup, "--timeout", args.timeout]
    return argv + (["--steps", args.steps, "--profile_to", profile_to] if profile_to else [])


def measure(args, model, world, jobs):
    """Every contender's job, taking turns for ``args.rounds`` rounds: per contender, its block's
    figures per round, and its final weights."""
    rounds = {name: [None] * args.rounds for name in jobs}
    block = args.block_of[model]
    with Relay(jobs, worker_argv(args, model), world, timeout=args.timeout) as relay:
        for name, why in relay.failures.items():
            print(f"{model} x{world} {name}: failed\n{why}", file=sys.stderr, flush=True)
        for r, name in turns(relay.jobs, args.rounds):
            rounds[name][r] = relay.ask(name, block)
            if rounds[name][r] is None:
                print(f"{model} x{world} {name}: failed in round {r + 1}", file=sys.stderr, flush=True)
        last = relay.finish()
        for name, why in relay.failures.items():
            print(f"{model} x{world} {name}: {why}", file=sys.stderr, flush=True)
    if args.verbose:
        for name, per_round in rounds.items():
            print(f"  {model} x{world} {name}: " + " ".join(f"{1e3 * res['median']:.3f}" if res else "-"
                                                         for res in per_round), file=sys.stderr, flush=True)
    ends = {name: last.get(name) or {} for name in jobs}
    return rounds, {n: end.get("weights") for n, end in ends.items()}, {n: end.get("mode", "?") for n, end in ends.items()}


def table(model, rounds, weights, modes):
    ddp = rounds["ddp"]
    header = ["contender", "ms/step (median)", "mean ms/step", "vs ddp (median of rounds)",
              "over ddp, ms/step", "CPU ms/step: thread", "process", "weights = ddp's",
              "mode at the end", "target"]
    rows = []
    for name, per_round in rounds.items():
        done = [(r, res) for r, res in enumerate(per_round) if res is not None and ddp[r] is not None]
        if not done:
            rows.append([name, "failed", "", "", "", "", "", "", "", ""])
            continue
        median = statistics.median(res["median"] for _, res in done)
        mean = statistics.median(res["mean"] for _, res in done)
        ratio = statistics.median(res["median"] / ddp[r]["median"] for r, res in done)
        over = statistics.median(res["median"] - ddp[r]["median"] for r, res in done)
        cpu = statistics.median(res["cpu"] for _, res in done)
        thread = statistics.median(res["thread"] for _, res in done)
        same = weights[name] is not None and weights[name] == weights["ddp"]
        target = ""
        if model == "tiny" and name.startswith("gradient_allreduce"):
            target = f"<= {TARGET:.2f}x {'met' if ratio <= TARGET else 'NOT met'}"
        if name.startswith("default"):
            target = f"<= {DEFAULT_TARGET:.2f}x {'met' if ratio <= DEFAULT_TARGET else 'NOT met'}"
        rows.append([name, f"{1e3 * median:.3f}", f"{1e3 * mean:.3f}", f"{ratio:.3f}x", f"{1e3 * over:+.3f}",
                     f"{1e3 * thread:.3f}", f"{1e3 * cpu:.3f}",
                     "yes" if same else "no", modes[name], target])
    return markdown(header, rows)


def profile(args, tmp):
    """One job of ``--profile`` per model and world size, cProfile in rank 0 after warm-up: the top
    entries by own time and by cumulative time."""
    import pstats
    env = contenders(args, tmp)[args.profile]
    for world in map(int, args.ranks.split(",")):
        for model in args.models.split(","):
            out = tmp / f"{model}-{world}.prof"
            why = launch.failed(launch.run_ranks(worker_argv(args, model, out), world, env=env, timeout=args.timeout))
            if why:
                print(f"{model} x{world}: failed\n{why}")
                continue
            text = io.StringIO()
            stats = pstats.Stats(str(out), stream=text)
            stats.sort_stats("tottime").print_stats(args.profile_lines)
            stats.sort_stats("cumulative").print_stats(args.profile_lines)
            print(f"## {args.profile}, {model}, {world} ranks, rank 0, {args.steps} steps after warm-up\n\n"
                  f"```\n{text.getvalue()}```\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,mlp")
    ap.add_argument("--ranks", default="2,4", help="comma-separated world sizes")
    ap.add_argument("--contenders", default="ddp,default,intercept," + ",".join(ALGORITHMS) + ",gradient_allreduce_1mib")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--block", type=int, default=100, help="steps per turn of the tiny model")
    ap.add_argument("--mlp_block", type=int, default=10, help="steps per turn of the mlp")
    ap.add_argument("--warmup", type=int, default=20, help="steps not timed at the start of each job")
    ap.add_argument("--steps", type=int, default=1000, help="steps profiled (--profile)")
    ap.add_argument("--baseline", help="another autopatch checkout, run as '<name> @baseline'")
    ap.add_argument("--profile", help="a contender to profile (rank 0, cProfile) instead of measuring")
    ap.add_argument("--profile_lines", type=int, default=30)
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per job, all ranks together")
    ap.add_argument("--verbose", action="store_true", help="print every block's median step")
    ap.add_argument("--quick", action="store_true", help="2 ranks, 3 rounds of 50 tiny steps: a smoke run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--profile_to", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.rounds, args.block, args.mlp_block, args.ranks = 3, 50, 5, "2"
    args.block_of = {"tiny": args.block, "mlp": args.mlp_block}
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
                rounds, weights, modes = measure(args, model, world, jobs)
                status |= any(res is None for per_round in rounds.values() for res in per_round)
                print(f"## {model}, {world} ranks, {args.rounds} rounds of {args.block_of[model]} steps "
                      f"per contender (after {args.warmup} not timed)\n")
                print(table(model, rounds, weights, modes) + "\n", flush=True)
    print(closing(started))
    return status


if __name__ == "__main__":
    sys.exit(main())
