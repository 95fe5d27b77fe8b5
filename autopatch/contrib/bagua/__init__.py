"""A stand-in for ``bagua.torch_api``: a script written for Bagua changes only its import.

    import autopatch.contrib.bagua as bagua        # was: import bagua.torch_api as bagua
    bagua.init_process_group()
    model = model.with_bagua([optimizer], bagua.algorithms.gradient_allreduce.GradientAllReduceAlgorithm())

Importing it gives every ``torch.nn.Module`` Bagua's ``with_bagua`` method, as importing Bagua
did; ``autopatch.disable()`` takes the method away with every other patch and ``enable()`` (or
``init_process_group()``) gives it back. Bagua's collective primitives, MoE layers, checkpoint helpers and SyncBatchNorm are not
here: docs/migrating-from-bagua.md names what replaces each.
"""

import os

import torch

from .. import fuse_optimizer  # noqa: F401  (bagua.contrib.fuse_optimizer is reached this way too)
from .. import with_bagua as _with_bagua_function
from . import algorithms  # noqa: F401
from ... import contrib  # noqa: F401
from ...patches.bagua_method import give_modules

__all__ = ["init_process_group", "get_rank", "get_world_size", "get_local_rank", "get_local_size",
           "with_bagua", "algorithms", "contrib"]


def init_process_group(store=None, rank=-1, world_size=-1, local_world_size=-1):
    """Bagua's ``init_process_group``: torch.distributed on NCCL when CUDA is there, else gloo,
    from the launcher's environment (``torchrun``) or the given store; and autopatch enabled."""
    import autopatch
    import torch.distributed as dist
    if local_world_size > 0:
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if store is None:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    if not autopatch.is_enabled():
        autopatch.enable()


def _env(name, default):
    return int(os.environ.get(name, default))


def get_rank():
    """This process's rank: torch.distributed's when it is set up, else the launcher's ``RANK``."""
    import torch.distributed as dist
    return dist.get_rank() if dist.is_initialized() else _env("RANK", 0)


def get_world_size():
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_initialized() else _env("WORLD_SIZE", 1)


def get_local_rank():
    return _env("LOCAL_RANK", 0)


def get_local_size():
    return _env("LOCAL_WORLD_SIZE", 1)


def with_bagua(self, optimizers, algorithm, process_group=None, do_flatten=True):
    """``model.with_bagua(optimizers, algorithm)``: see ``autopatch.contrib.with_bagua``."""
    return _with_bagua_function(self, optimizers, algorithm, process_group=process_group, do_flatten=do_flatten)


give_modules(with_bagua)
