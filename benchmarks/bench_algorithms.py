"""Bagua's communication algorithms on a shaped network: throughput and time to DDP's accuracy.

Four gloo ranks in private network namespaces whose link is shaped (``harness/netns.py``: 10
Gbit/s, 1 Gbit/s, 100 Mbit/s, and 1 Gbit/s + 5 ms one-way delay) train one unchanged DDP script
(``--worker``) on scikit-learn's handwritten digits: a wide MLP (64 -> W -> W -> 10, Adam), whose
step is communication-bound at 1 Gbit/s, since every float of the gradient costs few FLOPs (a
small batch per rank). Each contender is a job of its own, started zero-code:

- ``ddp``: torch's own DistributedDataParallel (autopatch off), the baseline;
- each algorithm: ``FUSEDOPT_ENABLE=1 FUSEDOPT_POLICY=<builtin policy>`` with ``FUSEDOPT_MODE=off``
  (the algorithm alone: fusion does not change what travels). ``decentralized_shift_one`` is the
  decentralized policy with ``peer_selection_mode: shift_one``, and qadam's policy gets
  ``warmup_steps`` of ``--qadam_warmup`` (its default of 100 steps is a third of this training).

Contenders alternate within one run, the first of each round rotating; figures are medians over
the rounds, ratios the median of per-round ratios. Throughput: samples per second from rank 0's
median step over the steps after warm-up. On the links in ``--accuracy_links`` DDP trains
``--epochs`` epochs and every algorithm twice as many (but gradient_allreduce and decentralized
with ``all``, which run at DDP's speed, as many, and async, which runs tens of times faster, twenty
times as many); rank 0's weights are kept every ``--eval_every`` steps (async: ten times fewer;
the copy's time is not counted) and scored on the test split afterwards.
Quoted: the training seconds each contender took to first reach DDP's final test accuracy of the
same round, over DDP's whole training time. Elsewhere every contender trains ``--steps`` steps
after its warm-up, for throughput only. Needs root (network namespaces, tc).

    python benchmarks/bench_algorithms.py                 # every link, 3 rounds
    python benchmarks/bench_algorithms.py --quick         # 1 Gbit/s, 1 round (~10 min)
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

from harness import launch, netns
from harness.machine import closing, summary
from harness.report import markdown

POLICIES = Path(__file__).resolve().parent.parent / "policies"
# Epochs each contender trains, in DDP's epochs, where accuracy is measured: enough to reach DDP's
# accuracy in DDP's time at its speed. Those at DDP's speed need no more than DDP's steps; async runs
# tens of times faster, and averages only every sync_interval_ms, so it needs many more epochs.
EPOCHS_FACTOR = {"ddp": 1, "gradient_allreduce": 1, "decentralized": 1, "async": 20}
TARGETS = {"bytegrad": 3.0, "low_precision_decentralized": 2.5, "qadam": 3.0, "decentralized_shift_one": 1.3,
           "async": 5.0}


# -- the unchanged training script -----------------------------------------------------------------
def worker(args):
    import torch
    import torch.distributed as dist
    from sklearn.datasets import load_digits
    from torch import nn
    torch.set_num_threads(1)
    rank = launch.init_rank()
    world = dist.get_world_size()
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = order[:1400], order[1400:]
    mine = train[rank::world]
    torch.manual_seed(0)
    w = args.width
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(64, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10)))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, fused=True)
    per_epoch = len(mine) // args.batch
    marks, kept, counted = [], [], 0.0
    start = time.perf_counter()
    for step in range(args.train_steps or args.train_epochs * per_epoch):
        epoch, i = divmod(step, per_epoch)
        if i == 0:
            perm = mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(100 * rank + epoch))]
        idx = perm[i * args.batch:(i + 1) * args.batch]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        marks.append(time.perf_counter() - start - counted)
        if rank == 0 and args.eval_every and (step + 1) % args.eval_every == 0:
            t = time.perf_counter()
            kept.append((step + 1, marks[-1], [p.detach().clone() for p in model.parameters()]))
            counted += time.perf_counter() - t
    results = {"marks": marks}
    if rank == 0:
        module = model.module
        accuracy = []
        with torch.no_grad():
            for step, at, weights in kept:
                for p, saved in zip(module.parameters(), weights):
                    p.copy_(saved)
                accuracy.append((step, at, (module(x[test]).argmax(1) == y[test]).float().mean().item() * 100))
        import autopatch
        section = autopatch.report().get("allreduce", {}) if autopatch.is_enabled() else {}
        results.update(accuracy=accuracy, algorithm=section.get("algorithm"))
    launch.save_results(results)
    dist.destroy_process_group()


# -- the launching side ----------------------------------------------------------------------------
def contenders(args, tmp, qadam_warmup):
    """name -> environment of its job (beyond the launcher's)."""
    def policy(name, *changes):
        text = (POLICIES / f"{name}.yaml").read_text()
        for old, new in changes:
            assert old in text, (name, old)
            text = text.replace(old, new)
        path = tmp / f"{name}-{qadam_warmup}.yaml"
        path.write_text(text)
        return path
    zero_code = {"FUSEDOPT_ENABLE": 1, "FUSEDOPT_MODE": "off"}
    out = {"ddp": {}}
    for name in args.contenders.split(","):
        if name == "ddp":
            continue
        if name == "decentralized_shift_one":
            path = policy("decentralized", ("peer_selection_mode: all", "peer_selection_mode: shift_one"))
        elif name == "qadam":
            path = policy("qadam", ("warmup_steps: null", f"warmup_steps: {qadam_warmup}"))
        else:
            path = POLICIES / f"{name}.yaml"
        out[name] = dict(zero_code, FUSEDOPT_POLICY=path)
    return out


def link(spec):
    rate, _, delay = spec.partition("+")
    netns.bits_per_second(rate)
    return rate, delay or None


def run_one(args, spec, name, env, warmup):
    """One job of contender ``name`` on link ``spec``: rank 0's results, or the reason it failed.
    ``warmup``: None where accuracy is measured, else qadam's warm-up steps (throughput only)."""
    rate, delay = link(spec)
    worker_args = [__file__, "--worker", "--width", args.width, "--batch", args.batch, "--lr", args.lr]
    if warmup is None:
        factor = EPOCHS_FACTOR.get(name, 2)
        # the kept weights stay a few dozen copies, whatever the epochs
        worker_args += ["--train_epochs", args.epochs * factor, "--eval_every", args.eval_every * max(1, factor // 2)]
    else:
        # async trains ten times the steps, so that averaging rounds (every 500 ms) fall in them
        worker_args += ["--train_steps", args.steps * (10 if name == "async" else 1) + (warmup if name == "qadam" else 0)]
    ranks = netns.run_ranks_shaped(worker_args, args.ranks, rate, delay, env=env, timeout=args.timeout)
    why = launch.failed(ranks)
    if why:
        return None, why
    return ranks[0].results, None


def throughput(args, name, results, warmup):
    """Samples per second from rank 0's median step after warm-up (qadam: its own warm-up)."""
    marks = results["marks"]
    skip = max(3, warmup + 2 if name == "qadam" else 0)
    steps = [b - a for a, b in zip(marks[skip - 1:], marks[skip:])]
    return args.ranks * args.batch / statistics.median(steps)


def reached(results, target):
    """Training seconds until rank 0's test accuracy first reached ``target``, or None."""
    return next((at for _, at, acc in results["accuracy"] if acc >= target), None)


def measure(args, spec, tmp, accuracy):
    """Every contender, ``args.rounds`` times in turns. Returns per contender and round its
    samples/s, training seconds and (with ``accuracy``) its accuracy curve; the algorithm's report
    section per contender; and the failures."""
    from harness.alternation import turns
    warmup = args.qadam_warmup if accuracy else args.throughput_qadam_warmup
    jobs = contenders(args, tmp, warmup)
    rounds = {name: [None] * args.rounds for name in jobs}
    sections, failures = {}, {}
    for r, name in turns(dict(jobs), args.rounds):
        results, why = run_one(args, spec, name, jobs[name], None if accuracy else warmup)
        if why:
            failures[name] = why
            print(f"{spec} {name}: failed\n{why}", file=sys.stderr)
            continue
        sections[name] = results.get("algorithm")
        row = {"samples_per_s": throughput(args, name, results, warmup), "seconds": results["marks"][-1]}
        if accuracy:
            row["final"] = results["accuracy"][-1][2]
            row["curve"] = results["accuracy"]
        rounds[name][r] = row
        print(f"  {spec} round {r + 1} {name}: {row['samples_per_s']:.0f} samples/s"
              + (f", final accuracy {row['final']:.2f}" if accuracy else ""), file=sys.stderr, flush=True)
    return rounds, sections, failures


def table(args, spec, rounds, sections, accuracy):
    header = ["contender", "samples/s (median)", "vs ddp (median of rounds)", "target"]
    if accuracy:
        header += ["final test acc. %", "s to DDP's final acc. / DDP's s (median)"]
    header += ["bytes sent per step", "waiting ms per step", "notes"]
    rows = []
    ddp = rounds["ddp"]
    for name, per_round in rounds.items():
        done = [(r, row) for r, row in enumerate(per_round) if row is not None and ddp[r] is not None]
        if not done:
            rows.append([name, "failed", "", "", *([""] * (2 if accuracy else 0)), "", "", ""])
            continue
        rate = statistics.median(row["samples_per_s"] for _, row in done)
        ratio = statistics.median(row["samples_per_s"] / ddp[r]["samples_per_s"] for r, row in done)
        target = TARGETS.get(name) if spec == "1gbit" else (0.95 if spec == "10gbit" and name != "ddp" else None)
        row_out = [name, f"{rate:.0f}", f"{ratio:.2f}x",
                   "" if target is None else f">= {target}x {'met' if ratio >= target else 'NOT met'}"]
        if accuracy:
            finals = [row["final"] for _, row in done]
            times = [reached({"accuracy": row["curve"]}, ddp[r]["final"]) for r, row in done]
            fractions = [t / ddp[r]["seconds"] for (r, _), t in zip(done, times) if t is not None]
            fraction = statistics.median(fractions) if len(fractions) == len(done) else None
            row_out += [f"{statistics.median(finals):.2f}",
                        f"{fraction:.2f}" + (" (<= 0.5 met)" if fraction <= 0.5 else " (> 0.5)") if fraction is not None
                        else f"not reached in {len(done) - len(fractions)} of {len(done)} rounds"]
        section = sections.get(name) or {}
        waited = f"{1e3 * section['wait_seconds'] / section['steps']:.0f}" if section.get("steps") else ""
        row_out += [section.get("bytes_sent_per_step", ""), waited, _note(name, section)]
        rows.append(row_out)
    return markdown(header, rows)


def _note(name, section):
    if name == "ddp":
        return "torch's reducer, autopatch off"
    if name == "async" and section:
        return f"{section.get('averaging_rounds', 0)} averaging rounds on rank 0"
    if name == "qadam" and section:
        return f"phase {section.get('phase')}"
    return ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--links", default="10gbit,1gbit,100mbit,1gbit+5ms",
                    help="comma-separated RATE or RATE+DELAY in tc's units")
    ap.add_argument("--accuracy_links", default="1gbit",
                    help="links where time to DDP's accuracy is measured (elsewhere throughput only)")
    ap.add_argument("--contenders", default="ddp,gradient_allreduce,bytegrad,decentralized,decentralized_shift_one,"
                                            "low_precision_decentralized,qadam,async")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--width", type=int, default=2048, help="hidden width W of the MLP 64 -> W -> W -> 10")
    ap.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=2, help="DDP's epochs where accuracy is measured")
    ap.add_argument("--eval_every", type=int, default=11, help="steps between kept weights (rank 0)")
    ap.add_argument("--steps", type=int, default=12, help="steps after warm-up where only throughput is measured")
    ap.add_argument("--qadam_warmup", type=int, default=20, help="qadam's warm-up steps where accuracy is measured")
    ap.add_argument("--throughput_qadam_warmup", type=int, default=3, help="... where throughput only is")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per job, all ranks together")
    ap.add_argument("--quick", action="store_true", help="1 Gbit/s only, 1 round")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--train_epochs", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--train_steps", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.links, args.rounds = "1gbit", 1
    started = time.perf_counter()
    print(f"# {args.ranks} gloo ranks, MLP 64 -> {args.width} -> {args.width} -> 10 (Adam, lr {args.lr}), "
          f"{args.batch} samples per rank per step; {summary()}")
    print(f"# {' '.join(sys.argv)}\n")
    import tempfile
    status = 0
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.links.split(","):
            accuracy = spec in args.accuracy_links.split(",")
            try:
                rounds, sections, failures = measure(args, spec, Path(tmp), accuracy)
            except netns.ShapingUnavailable as e:
                print(f"## {spec}: not measured: {e}\n")
                continue
            status |= bool(failures)
            print(f"## {spec}" + (f", DDP {args.epochs} epochs, the algorithms {2 * args.epochs} (async {20 * args.epochs})" if accuracy
                                  else f", {args.steps} steps after warm-up, throughput only") + "\n")
            print(table(args, spec, rounds, sections, accuracy) + "\n", flush=True)
    print(closing(started))
    return status


if __name__ == "__main__":
    sys.exit(main())
