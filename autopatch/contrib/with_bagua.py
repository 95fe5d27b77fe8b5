"""Bagua's ``model.with_bagua(optimizers, algorithm, process_group, do_flatten)``.

It wraps the model in ``DistributedDataParallel``, whose gradient sync autopatch takes over, runs
the algorithm for it, and makes every rank of the process group start from the group's first
rank's model and optimizer state, as Bagua did (DDP broadcasts the parameters and buffers; the
optimizers' state is broadcast here, see ``optimizer_broadcast.py``). It enables autopatch when it
is off (the policy ``FUSEDOPT_POLICY`` names, else ``default``), since the algorithms hear of
each optimizer step through autopatch's hooks. An optimizer given to ``fuse_optimizer``, before
or after, is fused by its ``fuse_step()`` and the algorithm still runs around each of its steps.

Called again for the same model (Bagua's way to switch algorithms), it keeps the model's one DDP
wrapper, closes the previous algorithm, broadcasts the model's and the optimizers' state again
and runs the new algorithm from the next forward on.

Unlike Bagua's, which returned the module itself, it returns the DDP model (its ``.module`` is
the user's module; ``state_dict()`` keys carry DDP's ``module.`` prefix), with Bagua's
``bagua_algorithm`` attribute (async's ``abort(model)`` / ``resume(model)``).
"""

import warnings
import weakref

import torch
import torch.distributed as dist

from ..dist import first_rank
from .optimizer_broadcast import broadcast_states

_wrapper_of = weakref.WeakKeyDictionary()     # the user's module -> the DDP model with_bagua made


def _takeover():
    import autopatch
    session = autopatch.session() or autopatch.enable()
    if session.allreduce is None:
        raise RuntimeError(f"with_bagua needs autopatch's takeover of DistributedDataParallel, which the "
                           f"policy {session.policy.source} turns off (allreduce.enabled: false)")
    return session


def _wrapper(model, process_group):
    """(the DDP model for ``model``, whether it was made earlier)."""
    ddp_class = torch.nn.parallel.DistributedDataParallel
    if isinstance(model, ddp_class):
        return model, True
    known = _wrapper_of.get(model)
    if known is not None:
        return known, True
    ddp = ddp_class(model, process_group=process_group)
    _wrapper_of[model] = ddp
    return ddp, False


def _broadcast_module(ddp):
    """The group's first rank's parameters and buffers, as DDP's construction broadcast them."""
    group = ddp.process_group
    src = first_rank(group)
    with torch.no_grad():
        for t in [*ddp.module.parameters(), *ddp.module.buffers()]:
            dist.broadcast(t, src=src, group=group)


def with_bagua(model, optimizers, algorithm, process_group=None, do_flatten=True):
    """Returns ``DistributedDataParallel(model)`` running ``algorithm``; every rank of the
    process group calls it together. ``do_flatten`` is accepted and has nothing left to do: the
    allreduce's buckets are flat."""
    session = _takeover()
    for opt in optimizers:
        session.optimizer(opt)         # KeyError: autopatch does not see this optimizer's steps
    ddp, again = _wrapper(model, process_group)
    if again:
        _broadcast_module(ddp)
    left = session.allreduce.use_algorithm(ddp, algorithm.choice())
    if left is not None:
        warnings.warn(f"autopatch: with_bagua: {algorithm.name} does not run, DDP keeps its own gradient sync: "
                      f"{left}", RuntimeWarning, stacklevel=2)
    broadcast_states(optimizers, ddp.process_group)
    ddp.bagua_algorithm = algorithm
    return ddp
