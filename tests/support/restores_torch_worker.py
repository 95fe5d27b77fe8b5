"""One process that trains a step under every builtin policy in turn, on a one-rank gloo group, and
says after each ``disable()`` what of torch differs from before the first ``enable()``.

``python restores_torch_worker.py CACHE_DIR`` prints one JSON line: ``{case: [difference, ...]}``:
what differs after ``disable()``, what the ledger still holds then, and what differed while
enabled that the ledger (autopatch/patches/ledger.py) did not record.
Each case also imports ``autopatch.contrib.bagua`` and calls ``model.with_bagua`` the way a
script written for Bagua does; the case ``data`` is the default policy with the data side on.
"""

import datetime
import importlib
import json
import sys

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.parallel.distributed as ddp_module
import torch.serialization
import torch.utils.data
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import autopatch
from autopatch.patches.ledger import LEDGER
from autopatch.policy import builtin_names
from training import batches, mlp

# Every class and module autopatch patches or may patch, by name.
TARGETS = {"Optimizer": torch.optim.Optimizer, "Adam": torch.optim.Adam, "Module": nn.Module,
           "Parameter": nn.Parameter, "Tensor": torch.Tensor, "DistributedDataParallel": DistributedDataParallel,
           "DataLoader": DataLoader, "torch": torch, "torch.serialization": torch.serialization,
           "torch.distributed": dist, "distributed_c10d": c10d, "torch.nn.parallel.distributed": ddp_module,
           "torch.utils.data": torch.utils.data}


def snapshot():
    return {name: dict(vars(target)) for name, target in TARGETS.items()}


def changed(before):
    """(target name, attribute, how) of what was added, removed or replaced since ``before``."""
    out = []
    for name, was in before.items():
        now = vars(TARGETS[name])
        out += [(name, k, "added") for k in now.keys() - was.keys()]
        out += [(name, k, "removed") for k in was.keys() - now.keys()]
        out += [(name, k, "replaced") for k in was.keys() & now.keys() if now[k] is not was[k]]
    return sorted(out)


def differences(before):
    return [f"{name}.{k} {how}" for name, k, how in changed(before)]


def unrecorded(before):
    """What differs from ``before`` now that the ledger does not hold: a patch made elsewhere."""
    recorded = {(id(owner), attr) for entry in LEDGER.installed().values() for owner, attr in entry["attributes"]}
    return [f"{name}.{k} {how} without the ledger" for name, k, how in changed(before)
            if (id(TARGETS[name]), k) not in recorded]


def one_step(bagua=False):
    """A DDP model fed by a DataLoader, two steps of Adam; with ``bagua``, made by ``with_bagua``
    as Bagua's scripts do, where the policy lets autopatch take DDP over (``with_bagua`` needs it)."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if bagua and autopatch.session().allreduce is not None:
        import autopatch.contrib.bagua as bagua_api
        ddp = model.with_bagua([opt], bagua_api.algorithms.gradient_allreduce.GradientAllReduceAlgorithm())
    else:
        ddp = DistributedDataParallel(model)
    x, y = zip(*batches(4))
    loader = DataLoader(TensorDataset(torch.cat(x), torch.cat(y)), batch_size=16)
    for inputs, targets in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(inputs), targets).backward()
        opt.step()


def main(cache_dir):
    store = dist.FileStore(f"{cache_dir}/store", 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    one_step()   # torch's own lazy set-up, done unpatched, is not a leftover patch
    before = snapshot()
    cases = {name: ((name,), {}) for name in builtin_names()}
    cases["data"] = (("default",), {"data": {"cache": {"backend": "local", "path": f"{cache_dir}/cache"}}})
    found = {}
    for case, (args, overrides) in cases.items():
        autopatch.enable(*args, **overrides)
        importlib.import_module("autopatch.contrib.bagua")   # as Bagua's scripts do
        assert hasattr(nn.Module, "with_bagua"), case
        one_step(bagua=True)
        while_enabled = unrecorded(before)
        autopatch.disable()
        found[case] = differences(before) + while_enabled + [f"the ledger still holds {t}" for t in LEDGER.installed()]
    dist.destroy_process_group()
    print(json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1])
