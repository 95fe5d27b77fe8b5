"""Who averages a DDP model's gradients: DDP's own reducer, unless the policy asks for autopatch's.

DDP's reducer (its own buckets, bookkeeping in C++) gives DDP's results at every world size at
DDP's speed. autopatch's bucketed allreduce pays a Python hook per parameter, and its buckets
are not DDP's: over more than two ranks gloo's ring then sums some gradients in another order.
So under ``allreduce.enabled: auto`` (the default) DDP keeps its gradient sync unless the policy
asks for something only autopatch's allreduce does: a communication algorithm other than
``gradient_allreduce``, compression, hierarchical reduce, or autotune searching the allreduce's
knobs where that keeps the results (two ranks, or ``fusion.exact: rounding``).
``allreduce.enabled: true`` takes every model over (backward fusion across processes, bucket
sizing), and the report says what that changes beyond two ranks.
"""

from ..tunables import ALLREDUCE, KNOBS
from ..vocabulary import GRADIENT_ALLREDUCE

KEPT = ("allreduce.enabled: auto keeps DDP's own reducer (DDP's results at every world size, at "
        "DDP's speed), since the policy asks for nothing only autopatch's allreduce does (a "
        "communication algorithm, compression, hierarchical reduce, autotune's allreduce knobs); "
        "allreduce.enabled: true takes the sync over for backward fusion and bucket sizing")


def why_not_bucket_search(world, exact):
    """Why autotune must not search bucket sizes for a job of ``world`` ranks, or None."""
    if world > 2 and exact == "bitwise":
        return (f"buckets other than DDP's sum gradients in another order over {world} ranks "
                "(fusion.exact: bitwise keeps DDP's results)")
    return None


def why_ddp_keeps(policy, world):
    """None when autopatch's allreduce should average a DDP model over ``world`` ranks under this
    policy; else why DDP's own reducer keeps it."""
    if policy.allreduce.enabled is True:
        return None
    if policy.algorithm.name != GRADIENT_ALLREDUCE or policy.allreduce.compression != "none" \
            or policy.allreduce.hierarchical:
        return None
    tune = policy.autotune
    searched = [k for k in tune.knobs if KNOBS[k].target == ALLREDUCE] if tune.enabled else []
    if searched and (searched != ["bucket_size_2p"] or why_not_bucket_search(world, policy.fusion.exact) is None):
        return None
    return KEPT


def changes_results(world, compression, hierarchical):
    """What autopatch's allreduce changes against DDP's results over ``world`` ranks, or None."""
    if compression != "none":
        return f"gradients travel as {compression}: averages within its rounding of DDP's"
    if hierarchical:
        return "reduced node by node: summed in another order than DDP's, within float rounding"
    if world > 2:
        return (f"buckets other than DDP's: over {world} ranks some gradients are summed in another "
                "order than DDP's, so results are within float rounding of DDP's, not bitwise")
    return None
