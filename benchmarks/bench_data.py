"""The data side, measured: which embedded store, what the sample cache saves, what balancing gives.

Three parts, each its own subcommand (all three by default):

``stores``   lmdb against diskcache, the two candidates for the node-local cache, used directly:
             write then read throughput with 2 processes (as 2 DataLoader workers) for three
             sample sizes, 6 processes writing the same keys at once, and use after fork.
``cache``    a DataLoader with 2 workers over a dataset that decodes a PNG per sample: epoch 1
             and 2 through the local store and through Redis, a second run's first epoch, and
             what a dataset that the probe refuses costs.
``balance``  4 gloo ranks train a small sequence model on long-tailed lengths, padded per batch:
             DistributedSampler against the load-balanced sampler put in its place by the data
             patches (steps grouped by complexity), and against the sampler without step
             grouping (balance alone); steps/s and the per-step spread of complexity.

Contenders take turns within one run and rounds repeat; figures are medians.

    python benchmarks/bench_data.py                 # every part, several minutes on 2 cores
    python benchmarks/bench_data.py stores --quick  # one part, smoke-sized
"""

import argparse
import io
import json
import multiprocessing as mp
import os
import pickle
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.machine import closing, load_average, summary  # noqa: E402
from harness.report import markdown  # noqa: E402

from autopatch.data import LoadBalancingDistributedSampler  # noqa: E402
from autopatch.data.sampling.step_balance import distributed_sampler_indices, spread_summary, step_spreads  # noqa: E402
from autopatch.data.store.node_servers import node_server_urls  # noqa: E402
from autopatch.data.store.redis_store import RedisStore  # noqa: E402
from autopatch.data.zero_code.patches import DataPatches  # noqa: E402

KiB = 1024
MiB = 1024 * KiB


# -- stores: the raw candidates ---------------------------------------------------------------
class LmdbCandidate:
    """lmdb as the cache would use it: no fsync (a cache may lose its last writes, never its
    consistency), one write transaction per batch, a read transaction per get."""
    name = "lmdb"

    def __init__(self, path):
        import lmdb
        self.env = lmdb.open(path, map_size=64 << 30, sync=False, metasync=False,
                             readahead=False, max_readers=512, lock=True)

    def mset(self, items):
        with self.env.begin(write=True) as txn:
            for k, v in items:
                txn.put(k, v)

    def get(self, key):
        with self.env.begin() as txn:
            return txn.get(key)


class DiskcacheCandidate:
    """diskcache with its size limit and least-recently-stored eviction; values of 32 KiB and
    more go to files of their own (its default), smaller ones into SQLite."""
    name = "diskcache"

    def __init__(self, path):
        import diskcache
        self.cache = diskcache.Cache(path, size_limit=64 << 30, eviction_policy="least-recently-stored",
                                     statistics=False)

    def mset(self, items):
        with self.cache.transact():
            for k, v in items:
                self.cache.set(k, v)

    def get(self, key):
        return self.cache.get(key)


CANDIDATES = {c.name: c for c in (LmdbCandidate, DiskcacheCandidate)}


def _value(i, size):
    """Deterministic incompressible bytes for key i."""
    return random.Random(i).randbytes(size)


def _store_worker(kind, path, keys, size, barrier, results, what, batch=20):
    store = CANDIDATES[kind](path)
    errors = 0
    if what == "write":
        batches = [[(str(k).encode(), _value(k, size)) for k in keys[s:s + batch]]
                   for s in range(0, len(keys), batch)]
    barrier.wait()
    t0 = time.perf_counter()
    if what == "write":
        for items in batches:
            try:
                store.mset(items)
            except Exception:   # a lock timeout counts as an error, not a crash of the benchmark
                errors += 1
    else:
        order = list(keys)
        random.Random(len(keys)).shuffle(order)
        for k in order:
            v = store.get(str(k).encode())
            errors += v is None or len(v) != size
    results.put((time.perf_counter() - t0, errors))


def run_phase(kind, path, n, size, what, procs=2, same_keys=False):
    """Wall seconds for ``procs`` processes to write or read n keys (split between them, or
    each all of them with ``same_keys``), and the error count."""
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(procs + 1), ctx.Queue()
    parts = [list(range(n))] * procs if same_keys else [list(range(p, n, procs)) for p in range(procs)]
    ps = [ctx.Process(target=_store_worker, args=(kind, path, part, size, barrier, results, what))
          for part in parts]
    for p in ps:
        p.start()
    try:
        barrier.wait(timeout=120)
    except threading.BrokenBarrierError:      # a worker died before it was ready: say so, never hang
        for p in ps:
            p.kill()
        raise RuntimeError(f"a {kind} worker did not get ready (exit codes {[p.exitcode for p in ps]}); "
                           "its traceback is above") from None
    t0 = time.perf_counter()
    out = [results.get(timeout=600) for _ in ps]
    wall = time.perf_counter() - t0
    for p in ps:
        p.join(timeout=60)
    return wall, sum(e for _, e in out)


def _fork_child(kind, path, q):
    """Use, in a forked child, the store object its parent opened; then open the store anew."""
    out = []
    for how in ("inherited", "reopened"):
        try:
            store = _INHERITED[0] if how == "inherited" else CANDIDATES[kind](path)
            got = store.get(b"parent")
            store.mset([(f"child-{how}".encode(), b"c" * 100)])
            out.append(f"{how}: " + ("ok" if got == b"p" * 100 else f"read {got!r:.20}"))
        except Exception as e:
            out.append(f"{how}: {type(e).__name__}: {e}"[:110])
    q.put(tuple(out))


_INHERITED = []


def fork_safety(kind, path):
    """Open in the parent, fork, use the same object in the child, then in the parent again."""
    ctx = mp.get_context("fork")
    store = CANDIDATES[kind](path)
    store.mset([(b"parent", b"p" * 100)])
    _INHERITED[:] = [store]
    q = ctx.Queue()
    p = ctx.Process(target=_fork_child, args=(kind, path, q))
    p.start()
    p.join(timeout=60)
    child = q.get(timeout=5) if not q.empty() else ("no answer", f"exit code {p.exitcode}")
    try:
        store.mset([(b"parent2", b"q" * 100)])
        after = "ok" if store.get(b"child-inherited") == b"c" * 100 and store.get(b"parent2") == b"q" * 100 else "data lost"
    except Exception as e:
        after = f"error: {type(e).__name__}: {e}"[:120]
    _INHERITED.clear()
    return child, after


def bench_stores(args):
    sizes = [(4 * KiB, "4 KiB (1k token ids)"), (147 * KiB, "147 KiB (224x224x3 uint8)"),
             (588 * KiB, "588 KiB (3x224x224 float32)")]
    volume = (24 if args.quick else 192) * MiB   # bytes written per size and round
    rounds = 1 if args.quick else 3
    kinds = list(CANDIDATES)
    rows, raw = [], {}
    root = Path(tempfile.mkdtemp(prefix="bench-stores-"))
    try:
        for r in range(rounds):
            for size, label in sizes:
                n = max(200, volume // size)
                for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                    path = str(root / f"{kind}-{r}-{size}")
                    w, we = run_phase(kind, path, n, size, "write")
                    rd, re_ = run_phase(kind, path, n, size, "read")
                    raw.setdefault((label, kind), []).append((n, size, w, rd, we + re_))
                    shutil.rmtree(path)
        for (label, kind), runs in raw.items():
            n, size = runs[0][0], runs[0][1]
            w = statistics.median(x[2] for x in runs)
            rd = statistics.median(x[3] for x in runs)
            rows.append((label, kind, f"{n / w:,.0f}", f"{n * size / w / MiB:,.0f}",
                         f"{n / rd:,.0f}", f"{n * size / rd / MiB:,.0f}", f"{1e6 * rd / n * 2:.0f}",
                         sum(x[4] for x in runs)))
        conc = []
        for kind in kinds:
            path = str(root / f"{kind}-same")
            n = 50 if args.quick else 300
            w, e = run_phase(kind, path, n, 147 * KiB, "write", procs=6, same_keys=True)
            rd, re_ = run_phase(kind, path, n, 147 * KiB, "read", procs=2)
            conc.append((kind, f"{6 * n / w:,.0f}", e, "all intact" if re_ == 0 else f"{re_} bad"))
            shutil.rmtree(path)
        forks = []
        for kind in kinds:
            path = str(root / f"{kind}-fork")
            child, after = fork_safety(kind, path)
            forks.append((kind, " / ".join(x for x in child if x), after))
            shutil.rmtree(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("### Throughput, 2 processes (writes in batches of 20, reads one key at a time, random order)\n")
    print(markdown(["sample", "store", "write samples/s", "write MiB/s", "read samples/s", "read MiB/s",
                    "read µs/sample/process", "errors"], rows))
    print("\n### 6 processes writing the same 147 KiB keys at once\n")
    print(markdown(["store", "writes/s (all processes)", "failed batches", "values read back"], conc))
    print("\n### The parent's open store used in a forked child, then in the parent\n")
    print(markdown(["store", "child: the parent's object / its own, opened after fork", "parent afterwards"], forks))


# -- cache: a DataLoader over a decoding dataset ------------------------------------------------
IMAGE_SIDE, OUT_SIDE = 416, 160   # a 416x416 PNG decoded and resized to 160x160: about 5 ms here


def make_images(n, path):
    """n PNG images (smooth gradients plus noise, so the codec has real work), saved to ``path``
    for the runs in other processes."""
    from PIL import Image
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:IMAGE_SIDE, 0:IMAGE_SIDE]
    base = np.stack([x * 255 // IMAGE_SIDE, y * 255 // IMAGE_SIDE, (x + y) * 127 // IMAGE_SIDE], -1)
    blobs = []
    for _ in range(n):
        img = (base + rng.integers(0, 48, base.shape)).clip(0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, "PNG")
        blobs.append(buf.getvalue())
    with open(path, "wb") as f:
        pickle.dump(blobs, f)
    return blobs


def load_images(path):
    with open(path, "rb") as f:
        return pickle.load(f)


class Indexed(Dataset):
    """A dataset made from one item per sample."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)


class PngDataset(Indexed):
    """Sample i: PNG i decoded and resized, as a 3x160x160 uint8 tensor, and a label."""

    def __getitem__(self, i):
        from PIL import Image
        img = Image.open(io.BytesIO(self.items[i])).convert("RGB").resize((OUT_SIDE, OUT_SIDE), Image.BILINEAR)
        return torch.from_numpy(np.array(img)).permute(2, 0, 1).contiguous(), i % 10


class AugmentedPng(PngDataset):
    """The same with a random flip: the probe must refuse it."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return (x.flip(2) if torch.rand(()) < 0.5 else x), y


def epoch_seconds(loader):
    t0 = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - t0


def _loader(dataset):
    return DataLoader(dataset, batch_size=16, num_workers=2)


def _patched(**settings):
    patches = DataPatches(**settings)
    patches.install()
    return patches


def _cache_round(kind, blobs, root, r):
    """(construction s, epoch 1 s, epoch 2 s, cached?) for one contender, from an empty cache."""
    patches = None
    if kind == "local":
        patches = _patched(cache="local", path=str(root / f"round{r}"))
    elif kind == "redis":
        RedisStore(hosts=node_server_urls(1 << 30)).clear()
        patches = _patched(cache="redis", capacity=1 << 30)
    try:
        t0 = time.perf_counter()
        loader = _loader(PngDataset(blobs))
        built = time.perf_counter() - t0
        e1, e2 = epoch_seconds(loader), epoch_seconds(loader)
        cached = patches is None or bool(patches.describe()["cache"]["datasets"])
    finally:
        if patches is not None:
            patches.uninstall()
    return built, e1, e2, cached


def second_run(blobs_path, cache_dir):
    """One program run under the patches: its DataLoader's construction and first epoch."""
    patches = _patched(cache="local", path=cache_dir)
    t0 = time.perf_counter()
    loader = _loader(PngDataset(load_images(blobs_path)))
    built = time.perf_counter() - t0
    e1 = epoch_seconds(loader)
    d = patches.describe()["cache"]
    print(json.dumps({"built": built, "epoch1": e1, "hits": d["hits"], "misses": d["misses"]}))


def _run_program(blobs_path, cache_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, __file__, "_second_run", blobs_path, cache_dir], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_cache(args):
    torch.set_num_threads(1)
    n = 96 if args.quick else 400
    rounds = 2 if args.quick else 4
    root = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    try:
        blobs_path = str(root / "images.pkl")
        blobs = make_images(n, blobs_path)
        t0 = time.perf_counter()
        for i in range(min(n, 40)):
            PngDataset(blobs)[i]
        per_sample = (time.perf_counter() - t0) / min(n, 40)
        kinds = ["uncached", "local", "redis"]
        runs = {k: [] for k in kinds}
        for r in range(rounds):
            for kind in kinds[r % 3:] + kinds[:r % 3]:
                runs[kind].append(_cache_round(kind, blobs, root, r))
        progs = []
        for r in range(rounds):
            cache_dir = str(root / f"program{r}")
            progs.append((_run_program(blobs_path, cache_dir), _run_program(blobs_path, cache_dir)))
        refusal = []
        for r in range(rounds):
            for patched in ([False, True] if r % 2 == 0 else [True, False]):
                patches = _patched(cache="local", path=str(root / "refused")) if patched else None
                try:
                    t0 = time.perf_counter()
                    loader = _loader(AugmentedPng(blobs))
                    built = time.perf_counter() - t0
                    refusal.append((patched, built, epoch_seconds(loader)))
                finally:
                    if patches is not None:
                        patches.uninstall()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = statistics.median
    print(f"{n} samples, one decode {1e3 * per_sample:.1f} ms in this process; DataLoader(batch_size=16, "
          f"num_workers=2); {rounds} rounds, contenders rotating, each from an empty cache.\n")
    rows = []
    for kind in kinds:
        rs = runs[kind]
        rows.append((kind, f"{med(x[0] for x in rs):.3f}", f"{med(x[1] for x in rs):.3f}",
                     f"{med(x[2] for x in rs):.3f}", f"{med(x[1] / x[2] for x in rs):.1f}x",
                     "yes" if all(x[3] for x in rs) else "NO"))
    print(markdown(["cache", "DataLoader() s", "epoch 1 s", "epoch 2 s", "epoch 1 / epoch 2", "cached"], rows))
    print(f"\nEpoch 1 through the cache against uncached (writing costs): local "
          f"{med(x[1] for x in runs['local']) / med(x[1] for x in runs['uncached']):.2f}, redis "
          f"{med(x[1] for x in runs['redis']) / med(x[1] for x in runs['uncached']):.2f}\n")
    rows = [("cold (empty cache)", f"{med(c['built'] for c, _ in progs):.3f}", f"{med(c['epoch1'] for c, _ in progs):.3f}",
             f"{med(c['hits'] for c, _ in progs):.0f} / {med(c['misses'] for c, _ in progs):.0f}"),
            ("second run", f"{med(w['built'] for _, w in progs):.3f}", f"{med(w['epoch1'] for _, w in progs):.3f}",
             f"{med(w['hits'] for _, w in progs):.0f} / {med(w['misses'] for _, w in progs):.0f}")]
    print("Separate program runs (a fresh process each, local store):\n")
    print(markdown(["run", "DataLoader() s", "epoch 1 s", "hits / misses"], rows))
    print(f"\nsecond run's epoch 1 faster than a cold one: {med(c['epoch1'] / w['epoch1'] for c, w in progs):.1f}x "
          "(median of per-round ratios)\n")
    plain = [x for x in refusal if not x[0]]
    patched = [x for x in refusal if x[0]]
    probe = med(x[1] for x in patched) - med(x[1] for x in plain)
    epoch = med(x[2] for x in plain)
    print(markdown(["random-flip dataset", "DataLoader() s", "epoch s"],
                   [("unpatched", f"{med(x[1] for x in plain):.3f}", f"{epoch:.3f}"),
                    ("patched (probe refuses)", f"{med(x[1] for x in patched):.3f}", f"{med(x[2] for x in patched):.3f}")]))
    print(f"\nthe refusing probe costs {1e3 * probe:.1f} ms = {100 * probe / epoch:.2f}% of an epoch; "
          f"patched epoch / unpatched epoch {med(x[2] for x in patched) / epoch:.3f}")


# -- balance: 4 gloo ranks, long-tailed sequences padded per batch -----------------------------
BATCH, WORLD = 8, 4


def sequence_lengths(n, seed=0):
    rng = random.Random(seed)
    return [min(512, int(8 * rng.paretovariate(1.0))) for _ in range(n)]


class Tokens(Indexed):
    """Sample i: token ids of the i-th length, and a label."""

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randint(1, 1000, (self.items[i],), generator=g), i % 10


def pad_batch(batch):
    longest = max(len(x) for x, _ in batch)
    tokens = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, (x, _) in enumerate(batch):
        tokens[row, :len(x)] = x
    return tokens, torch.tensor([y for _, y in batch])


def balance_rank(rank, init, steps):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(1000, 64, padding_idx=0)
            self.layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
            self.head = nn.Linear(64, 10)

        def forward(self, tokens):
            pad = tokens == 0
            h = self.layer(self.emb(tokens), src_key_padding_mask=pad)
            h = h.masked_fill(pad[..., None], 0).sum(1) / (~pad).sum(1, keepdim=True)
            return self.head(h)

    lengths = sequence_lengths(WORLD * BATCH * steps)
    dataset = Tokens(lengths)
    model = DDP(Model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    plain_sampler = DistributedSampler(dataset, seed=0)
    plain = DataLoader(dataset, batch_size=BATCH, sampler=plain_sampler, collate_fn=pad_batch)
    patches = _patched(balance="len")
    user_sampler = DistributedSampler(dataset, seed=0)
    balanced = DataLoader(dataset, batch_size=BATCH, sampler=user_sampler, collate_fn=pad_batch)
    assert type(balanced.sampler).__name__ == "FollowingSampler"
    ungrouped_sampler = LoadBalancingDistributedSampler(dataset, None, complexities=lengths, seed=0)
    ungrouped = DataLoader(dataset, batch_size=BATCH, sampler=ungrouped_sampler, collate_fn=pad_batch)
    contenders = {"DistributedSampler": (plain, plain_sampler), "balanced": (balanced, user_sampler),
                  "balanced, steps not grouped": (ungrouped, ungrouped_sampler)}
    times, spreads, padded = ({name: [] for name in contenders} for _ in range(3))
    rounds = int(os.environ.get("BENCH_ROUNDS", "3"))
    names = list(contenders)
    for r in range(rounds + 1):   # round 0 warms up
        for name in names[r % 3:] + names[:r % 3]:
            loader, sampler = contenders[name]
            sampler.set_epoch(r)
            dist.barrier()
            t0 = time.perf_counter()
            n = 0
            for tokens, labels in loader:
                opt.zero_grad()
                nn.functional.cross_entropy(model(tokens), labels).backward()
                opt.step()
                n += 1
            dist.barrier()
            if r == 0:
                continue
            times[name].append(n / (time.perf_counter() - t0))
            every = (distributed_sampler_indices(dataset, WORLD, 0, r, True, False) if name == "DistributedSampler"
                     else loader.sampler.rank_indices())
            spreads[name] += step_spreads(every, lengths, BATCH)
            padded[name].append(sum(max(BATCH * max(lengths[i] for i in ix[s:s + BATCH]) for ix in every)
                                    for s in range(0, len(every[0]), BATCH)))
    patches.uninstall()
    if rank == 0:
        print(json.dumps({"times": times, "spreads": {k: spread_summary(v) for k, v in spreads.items()},
                          "padded": padded, "steps": len(plain)}))
    dist.destroy_process_group()


def bench_balance(args):
    steps = 12 if args.quick else 40
    rounds = 2 if args.quick else 5
    init = tempfile.mktemp(prefix="bench-balance-init-")
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", BENCH_ROUNDS=str(rounds))
    procs = [subprocess.Popen([sys.executable, __file__, "_balance_rank", str(r), init, str(steps)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(WORLD)]
    outs = [p.communicate(timeout=1800) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("\n".join(o[1][-2000:] for o in outs))
    result = json.loads(outs[0][0].strip().splitlines()[-1])
    t, sp, pad = result["times"], result["spreads"], result["padded"]
    ratios = [b / d for b, d in zip(t["balanced"], t["DistributedSampler"])]
    ungrouped = [b / d for b, d in zip(t["balanced, steps not grouped"], t["DistributedSampler"])]
    print(f"{WORLD} gloo ranks (1 thread each) on this machine's cores; a TransformerEncoderLayer (d=64) on "
          f"token sequences of lengths 8..512 (Pareto, alpha 1), batch {BATCH} per rank padded to its longest, "
          f"{result['steps']} steps per epoch, {rounds} rounds after a warm-up round, contenders alternating.\n")
    rows = [(name, f"{statistics.median(t[name]):.2f}", f"{sp[name]['median']:.3f}", f"{sp[name]['worst']:.3f}",
             f"{statistics.median(pad[name]):,.0f}") for name in t]
    print(markdown(["sampler", "steps/s", "complexity max/mean per step (median)", "(worst)",
                    "padded tokens per epoch, slowest rank per step"], rows))
    print(f"\nbalanced / DistributedSampler steps/s: {statistics.median(ratios):.2f}x "
          f"(per-round ratios {', '.join(f'{x:.2f}' for x in ratios)}); steps not grouped: "
          f"{statistics.median(ungrouped):.2f}x")


# -- main -------------------------------------------------------------------------------------
PARTS = {"stores": bench_stores, "cache": bench_cache, "balance": bench_balance}


def main():
    if sys.argv[1:2] == ["_second_run"]:
        return second_run(*sys.argv[2:4])
    if sys.argv[1:2] == ["_balance_rank"]:
        return balance_rank(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts", nargs="*", help=f"some of {', '.join(PARTS)} (default: all)")
    ap.add_argument("--quick", action="store_true", help="smoke-sized: one round, small volumes")
    args = ap.parse_args()
    started = time.perf_counter()
    print(f"{summary()}\n")
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}; choose from {list(PARTS)}")
    for part in args.parts or PARTS:
        print(f"## {part}\n")
        PARTS[part](args)
        print(f"\n(load average after: {load_average()})\n")
    print(closing(started))


if __name__ == "__main__":
    main()
