"""FSDP2 as the benchmarks set it up: torch's ``fully_shard`` wherever this torch keeps it, a
process group of one rank without a launcher, and models sharded the way training recipes shard
them (each block, then the root)."""

import torch.distributed as dist
from torch import nn


def fully_shard_function():
    """torch's FSDP2 ``fully_shard``; ImportError where this torch has none."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard     # where older torch keeps it
    return fully_shard


def one_rank_group(backend):
    """The default process group of a job of one rank, without a launcher or a port."""
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def shard_gpt2(model):
    """Every GPT-2 block, then the root (which holds the tied embedding)."""
    fully_shard = fully_shard_function()
    for block in model.transformer.h:
        fully_shard(block)
    return fully_shard(model)


def shard_mlp(model):
    """Every Linear of a stack, then the root."""
    fully_shard = fully_shard_function()
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    return fully_shard(model)
