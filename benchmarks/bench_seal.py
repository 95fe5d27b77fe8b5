"""What the cache's integrity costs: sealing and verifying an entry, per sample, against the
unsealed read, and how long the decision whether the cache pays takes.

``seal``    per sample size (4 KiB token ids, 147 KiB uint8 image, 588 KiB float32 image), batches
            of 16 from a node-local lmdb store: the read as it would be without a seal (``mget``
            and decode) against the cache's read (``mget``, HMAC check, decode), and writing
            (encode) against writing a sealed entry (encode and HMAC). The contenders alternate
            within each round; medians of the rounds and the median of per-round ratios.
``payoff``  ``cache_pays`` on the probe's 16 samples (scratch entries written, read back 15
            times, deleted; the answer agreed through the job's store when there is one).

    python benchmarks/bench_seal.py            # both parts, about a minute on 2 cores
    python benchmarks/bench_seal.py --rounds 3 # smoke-sized
"""

import argparse
import statistics
import tempfile
import time
import types

import torch

from autopatch.data.cache.cache_loader import CacheLoader
from autopatch.data.probe.cache_payoff import cache_pays
from autopatch.data.store.entry_seal import Seal
from autopatch.data.store.local_store import LocalStore
from autopatch.data.store.sample_codec import decode, encode
from autopatch.data.store.user_key import derived

BATCH = 16
SAMPLES = {
    "4 KiB (1k int32 token ids)": lambda i: (torch.randint(0, 50000, (1024,), dtype=torch.int32), i),
    "147 KiB (224x224x3 uint8)": lambda i: (torch.randint(0, 256, (224, 224, 3), dtype=torch.uint8), i),
    "588 KiB (3x224x224 float32)": lambda i: (torch.rand(3, 224, 224), i),
}


def per_sample(fn, batches):
    start = time.perf_counter()
    for b in range(batches):
        fn(b)
    return (time.perf_counter() - start) / (batches * BATCH) * 1e6


def seal_part(rounds, batches):
    seal = Seal(derived("entries"))
    stamp = b"\0" * 16 + b"/t1"
    for label, make in SAMPLES.items():
        samples = [make(i) for i in range(BATCH * 4)]
        names = [f"bench_{i}" for i in range(len(samples))]
        payloads = [encode(s) for s in samples]
        with tempfile.TemporaryDirectory() as place:
            store = LocalStore(place, capacity=1 << 30)
            store.mset({f"plain/{n}": p for n, p in zip(names, payloads)})
            store.mset({n: seal.close(n.encode(), stamp, p) for n, p in zip(names, payloads)})

            def batch_names(b):
                first = (b * BATCH) % len(names)
                return names[first:first + BATCH]

            def read_plain(b):
                for raw in store.mget([f"plain/{n}" for n in batch_names(b)]):
                    decode(raw)

            def read_sealed(b):
                chosen = batch_names(b)
                for n, raw in zip(chosen, store.mget(chosen)):
                    decode(seal.open(n.encode(), stamp, raw))

            def write_plain(b):
                for s in samples[:BATCH]:
                    encode(s)

            def write_sealed(b):
                for n, s in zip(names, samples[:BATCH]):
                    seal.close(n.encode(), stamp, encode(s))

            contenders = {"read unsealed": read_plain, "read sealed": read_sealed,
                          "encode": write_plain, "encode + seal": write_sealed}
            times = {k: [] for k in contenders}
            for r in range(rounds):
                order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
                for k in order:
                    times[k].append(per_sample(contenders[k], batches))
            store.shutdown()
        for a, b in (("read unsealed", "read sealed"), ("encode", "encode + seal")):
            ratio = statistics.median(y / x for x, y in zip(times[a], times[b]))
            print(f"| {label} | {a} / {b} | {statistics.median(times[a]):.1f} | {statistics.median(times[b]):.1f} | "
                  f"+{statistics.median(times[b]) - statistics.median(times[a]):.1f} | {ratio:.3f} |", flush=True)


def payoff_part(rounds):
    for label, make in SAMPLES.items():
        times = []
        for r in range(rounds):
            with tempfile.TemporaryDirectory() as place:
                loader = CacheLoader("local", f"payoff{r}", path=place)
                verdict = types.SimpleNamespace(samples={i: encode(make(i)) for i in range(BATCH)}, load_seconds=1e-3)
                start = time.perf_counter()
                pays, why = cache_pays(loader, verdict)
                times.append(time.perf_counter() - start)
                loader.close()
        print(f"| {label} | {1e3 * statistics.median(times):.1f} ms | {1e3 * min(times):.1f} | {1e3 * max(times):.1f} | "
              f"{why[:60]} |", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", nargs="?", choices=["seal", "payoff"])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--batches", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.part in (None, "seal"):
        print("| sample | contenders | µs/sample first | µs/sample second | difference | second / first (median of rounds) |")
        print("|---|---|---|---|---|---|")
        seal_part(args.rounds, args.batches)
    if args.part in (None, "payoff"):
        print("| sample | cache_pays median | min | max | its reason |")
        print("|---|---|---|---|---|")
        payoff_part(args.rounds)
