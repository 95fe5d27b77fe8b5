"""A training job's data loop, as an unchanged program runs it: ``python data_job.py OUT [options]``.

It builds a DataLoader over one of the datasets of ``data_fixtures`` and saves every batch of
every epoch to OUT (a torch file), with autopatch's report when it is enabled. The fault tests
run it unpatched and patched and compare the batches; options make it wait for a signal, kill
the cache's Redis server mid-epoch, rewrite a file between epochs, or enable and disable autopatch
over and over.
"""

import argparse
import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader

import data_fixtures

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--dataset", default="Features")
ap.add_argument("--n", type=int, default=48)
ap.add_argument("--version", type=int, default=0)
ap.add_argument("--width", type=int, default=6)
ap.add_argument("--base", default="", help="comma-separated indices kept at version 0 (Patched)")
ap.add_argument("--workers", type=int, default=2)
ap.add_argument("--epochs", type=int, default=2)
ap.add_argument("--threads", type=int, default=0, help="torch threads of the main process")
ap.add_argument("--load-seconds", type=float, default=data_fixtures.LOAD_SECONDS)
ap.add_argument("--kill-redis", action="store_true", help="kill the cache's Redis server in epoch 2")
ap.add_argument("--wait-for-signal", action="store_true", help="after epoch 1, say 'ready' and sleep")
ap.add_argument("--own-handler", action="store_true", help="install a SIGTERM handler that exits with 3")
ap.add_argument("--root", help="the directory of a file-backed dataset (Files, Folder)")
ap.add_argument("--rewrite", default="", help="PATH=SOURCE: after epoch 1, PATH is rewritten with SOURCE's bytes")
args = ap.parse_args()

if args.threads:
    torch.set_num_threads(args.threads)
if args.own_handler:
    import signal

    def handler(signum, frame):
        print("own handler ran", flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, handler)

kw = {"load_seconds": args.load_seconds, "width": args.width}
if args.dataset == "Patched":
    kw["base"] = [int(i) for i in args.base.split(",") if i]
if args.version:
    kw["version"] = args.version
if args.dataset == "Files":
    dataset = data_fixtures.Files(args.root, args.n, load_seconds=args.load_seconds)
elif args.dataset == "Folder":
    dataset = data_fixtures.Folder(args.root, load_seconds=args.load_seconds)
else:
    dataset = getattr(data_fixtures, args.dataset)(args.n, **kw)
loader = DataLoader(dataset, batch_size=4, num_workers=args.workers, shuffle=False)
epochs = []
for epoch in range(args.epochs):
    batches = []
    for b, batch in enumerate(loader):
        if args.kill_redis and epoch == 1 and b == 1:
            from autopatch.data.store.node_servers import started_server
            started_server().kill()
        batches.append(batch)
    epochs.append(batches)
    if args.rewrite and epoch == 0:
        path, _, source = args.rewrite.partition("=")
        with open(source, "rb") as f, open(path, "wb") as out:
            out.write(f.read())
    if args.wait_for_signal and epoch == 0:
        print("ready", flush=True)
        time.sleep(600)
import autopatch  # noqa: E402  (imported last, so that an unpatched run never imports it)
report = autopatch.report().get("data") if autopatch.session() is not None else None
torch.save({"epochs": epochs, "report": report, "threads": torch.get_num_threads()}, args.out)
print(json.dumps({"pid": os.getpid()}))
