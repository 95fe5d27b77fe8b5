"""The GPU runs' process runner: every contender of a workload in a process of its own, warmed
up one at a time, then taking turns round by round; and the training-result check, each contender
in a fresh process against unpatched's saved state."""

import os

from .alternation import turns
from .gpu_contenders import UNPATCHED, unavailable
from .gpu_job import Job, check_worker
from .processes import Worker, WorkerError, serve
from .report import log


def measure(ctx, key, contenders, opts):
    """All contenders of one workload, taking turns; per contender its raw figures or why it has none."""
    results, live = {}, {}
    for c in contenders:
        why = unavailable(key, c)
        results[c.name] = {"label": c.label, "status": "n/a", "note": why} if why else {"label": c.label}
        if not why:
            live[c.name] = Worker(ctx, serve, Job, key, c, opts, timeout=opts["timeout"])

    def drop(name, status, note):
        results[name].update(status=status, note=note)
        live.pop(name).close()
        if status == "failed":
            log(f"  {key} / {name} failed:\n{note}")

    def each(fn):
        for name in list(live):
            try:
                fn(name, live[name])
            except WorkerError as e:
                drop(name, "failed", str(e))

    def hello(name, w):
        msg = w.answer()
        if "skip" in msg:
            drop(name, "skipped", msg["skip"])
        else:
            results[name].update(status="ok", hello=msg, rounds=[], peaks=[])

    each(hello)
    each(lambda name, w: results[name].update(warmup=w.ask("warm_up", opts["warmup"])))
    for _, name in turns(live, opts["rounds"]):
        if "unpatched" not in live:
            break
        try:
            turn = live[name].ask("turn", opts["steps"])
        except WorkerError as e:
            drop(name, "failed", str(e))
            continue
        results[name]["rounds"].append(turn["steps"])
        results[name]["peaks"].append(turn["peak"])
    each(lambda name, w: results[name].update(final=w.ask("finish", opts["sync_check"])))
    for w in live.values():
        w.close()
    return results


def check(ctx, key, contenders, opts, tmp):
    """Training-result check of every contender against unpatched; per contender its outcome."""
    path = os.path.join(tmp, f"{key}-reference.pt")
    out = {}

    def run(batch):
        workers = {c.name: Worker(ctx, check_worker, key, c, opts, path, c is UNPATCHED,
                                  timeout=opts["timeout"]) for c in batch}
        for name, w in workers.items():
            try:
                out[name] = w.answer()
            except WorkerError as e:
                out[name] = {"failed": str(e).strip().splitlines()[-1], "trace": str(e)}
            w.close()

    run([UNPATCHED])
    if "equal" not in out["unpatched"] and "modes" not in out["unpatched"]:
        return dict(out, **{c.name: {"failed": "the unpatched reference could not be trained"}
                            for c in contenders if c is not UNPATCHED})
    rest = [c for c in contenders if c is not UNPATCHED and unavailable(key, c) is None]
    for i in range(0, len(rest), opts["parallel_checks"]):
        run(rest[i:i + opts["parallel_checks"]])
    if os.path.exists(path):
        os.remove(path)
    return out
