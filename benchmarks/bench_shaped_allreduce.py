"""A plain torch.distributed all_reduce on gloo ranks over a shaped network: does its time follow the rate and the delay?

The check of ``harness/netns.py`` that communication benchmarks rely on: N gloo ranks on a network
shaped to each rate (and added one-way delay) in turn, plus unshaped loopback for scale; every
rank all-reduces a float32 tensor of ``--mib`` MiB ``--repeats`` times, and one of 1 KiB as often
(after a warm-up of one each). Quoted: rank 0's median seconds per all_reduce, the time the rate
alone allows the large one (a ring all_reduce puts 2 (N - 1) S bytes through the shared link),
their ratio, and the small one's time (with a delay: a ring's 2 (N - 1) steps wait for it each).
Needs root.

    python benchmarks/bench_shaped_allreduce.py                   # 10gbit, 1gbit, 100mbit, 1gbit+5ms
    python benchmarks/bench_shaped_allreduce.py --quick           # 1gbit, 100mbit, 1gbit+5ms, 2 repeats
"""

import argparse
import statistics
import sys
import time

from harness import launch, netns
from harness.machine import summary
from harness.report import markdown

MiB = 2**20


def worker(args):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    launch.init_rank()
    small, large = torch.ones(256), torch.ones(args.mib * MiB // 4)
    times = {"small": [], "large": []}
    for _ in range(args.repeats + 1):           # the first of each warms up
        for name, data in (("small", small), ("large", large)):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(data)
            times[name].append(time.perf_counter() - t0)
    total = dist.get_world_size() ** (args.repeats + 1)
    if dist.get_rank() == 0:
        launch.save_results({name: t[1:] for name, t in times.items()}
                            | {"sum_ok": bool(small[0].item() == total == large[-1].item())})
    dist.destroy_process_group()


def link(spec):
    """'1gbit' or '1gbit+5ms' as (rate, delay); 'loopback' as (None, None)."""
    if spec == "loopback":
        return None, None
    rate, _, delay = spec.partition("+")
    netns.bits_per_second(rate)
    return rate, delay or None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--links", default="loopback,10gbit,1gbit,100mbit,1gbit+5ms",
                    help="comma-separated: loopback (unshaped), RATE or RATE+DELAY in tc's units")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mib", type=int, default=8, help="MiB all-reduced per call")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per link, all ranks together")
    ap.add_argument("--quick", action="store_true", help="1gbit, 100mbit and 1gbit+5ms, 2 repeats")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.links, args.repeats = "1gbit,100mbit,1gbit+5ms", 2
    rank_args = [__file__, "--worker", "--mib", args.mib, "--repeats", args.repeats]
    ring_bits = 2 * (args.ranks - 1) * args.mib * MiB * 8
    print(f"# {args.ranks} gloo ranks, all_reduce of {args.mib} MiB float32, {args.repeats} times each; "
          f"{summary()}\n")
    rows, status = [], 0
    for spec in args.links.split(","):
        rate, delay = link(spec)
        try:
            if rate is None:
                ranks = launch.run_ranks(rank_args, args.ranks, timeout=args.timeout)
            else:
                ranks = netns.run_ranks_shaped(rank_args, args.ranks, rate, delay, timeout=args.timeout)
        except netns.ShapingUnavailable as e:
            rows.append([spec, "not measured", "", "", "", str(e).splitlines()[0]])
            continue
        why = launch.failed(ranks)
        if why or not ranks[0].results["sum_ok"]:
            print(f"{spec}: {why or 'wrong all_reduce result'}", file=sys.stderr)
            rows.append([spec, "failed", "", "", "", ""])
            status = 1
            continue
        took, small = (statistics.median(ranks[0].results[k]) for k in ("large", "small"))
        note = f"{ring_bits / took / 1e9:.2f} Gbit/s through the link"
        if delay:
            note += "; rate and delay from the user-space delay line"
        expected = ring_bits / netns.bits_per_second(rate) if rate else None
        rows.append([spec, f"{took:.3f}", "" if expected is None else f"{expected:.3f}",
                     "" if expected is None else f"{took / expected:.2f}", f"{1e3 * small:.1f}", note])
    print(markdown(["link", f"{args.mib} MiB all_reduce s (median)", "s the rate allows", "measured / rate's",
                    "1 KiB all_reduce ms (median)", "note"], rows))
    return status


if __name__ == "__main__":
    sys.exit(main())
