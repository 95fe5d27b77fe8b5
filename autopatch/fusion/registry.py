"""The one place that builds a strategy: which class runs a mode for a given optimizer.

An optimizer over DTensors (FSDP2, tensor parallel) steps its plain local shards under
``multi_layer`` (backward and forward are refused for it before this is asked); one whose state
is sharded across ranks steps its share of the flat buffers under ``multi_layer`` and
``backward``; every other optimizer gets the flat-buffer strategy of its mode.
"""

import weakref

from ..vocabulary import BACKWARD, FORWARD, MULTI_LAYER
from .backward import BackwardFusion
from .flattenable import holds_dtensors
from .forward import ForwardFusion
from .local_shards import LocalShardStep
from .multi_layer import MultiLayerStep
from .sharding.sharded_backward import ShardedBackward
from .sharding.sharded_step import ShardedStep


# strategy -> (a weak reference to its optimizer, its mode), held weakly: those still alive
_built = weakref.WeakKeyDictionary()


def alive(opt):
    """The modes of the strategies built for ``opt`` that are still alive, sorted. A mode left
    (a switch, mode auto's race) must leave nothing behind: its hooks would cost every step and
    its flat buffers memory, so once a switch is over this is the active mode's alone."""
    return sorted(mode for ref, mode in list(_built.values()) if ref() is opt)


def build(mode, opt, chunk_bytes, *, owned_storages, route, averaged_by=None, strict=False, shard=None,
          shards=None):
    """The strategy running ``opt`` in ``mode``.

    ``owned_storages``: the optimizer's flat buffers, shared by every mode it runs in, so the next
    mode adopts the params and state where the last one left them; ``route``: how chunks are
    stepped (routes.py); ``averaged_by``: across processes, what tells backward fusion that a
    bucket's gradients are averaged; ``strict``: backward fusion raises on accumulation (the user
    named the mode) instead of stepping the rest unfused and saying why; ``shard``: under
    multi_layer and backward, the collectives over the ranks that share the optimizer state
    (None: unsharded); ``shards``: what the last sharded mode handed over, taken as it is.
    """
    strategy = _strategy(mode, opt, chunk_bytes, owned_storages, route, averaged_by, strict, shard, shards)
    _built[strategy] = (weakref.ref(opt), mode)
    return strategy


def _strategy(mode, opt, chunk_bytes, owned_storages, route, averaged_by, strict, shard, shards):
    if mode == MULTI_LAYER:
        if holds_dtensors(opt):
            return LocalShardStep(opt, chunk_bytes)
        if shard is not None:
            return ShardedStep(opt, chunk_bytes, shard, owned_storages=owned_storages, shards=shards)
        return MultiLayerStep(opt, chunk_bytes, owned_storages=owned_storages, route=route)
    if mode == FORWARD:
        return ForwardFusion(opt, chunk_bytes, owned_storages=owned_storages, route=route)
    if mode == BACKWARD:
        if shard is not None:
            return ShardedBackward(opt, chunk_bytes, shard, averaged_by, owned_storages=owned_storages,
                                   strict=strict, shards=shards)
        return BackwardFusion(opt, chunk_bytes, owned_storages=owned_storages, averaged_by=averaged_by,
                              strict=strict, route=route)
    raise ValueError(f"no strategy runs mode {mode!r}")
