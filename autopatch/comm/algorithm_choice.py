"""Which communication algorithm a DDP model gets, and with which settings, from the policy.

The policy's ``algorithm`` section names it with Bagua's arguments. ``gradient_allreduce`` and
``bytegrad`` are settings of the bucketed allreduce (bytegrad: 8-bit min-max compression); the
others are objects of ``comm/algorithms/``, built per model from the keys their constructor takes
(a key it does not take is ignored; None leaves the algorithm's own default).

``hierarchical: null`` means hierarchical when the job spans several nodes, which every rank of
the world learns together when a model is built (a small all-gather of node ids). For
``gradient_allreduce`` it leaves ``allreduce.hierarchical`` in charge, so the default stays DDP's
arithmetic. Settings that cannot work with this world (``shift_one`` with an odd number of
participants, ``hierarchical`` over a group smaller than the world) are a ``PolicyError`` raised
where the model is built, on every rank alike, before any step.
"""

import inspect

import torch
import torch.distributed as dist

from ..policy import PolicyError
from ..vocabulary import ALGORITHMS, BYTEGRAD, GRADIENT_ALGORITHMS, GRADIENT_ALLREDUCE
from .collectives import all_gather_into
from .hierarchy import node_id

SETTINGS = ("hierarchical", "peer_selection_mode", "communication_interval", "sync_interval_ms", "warmup_steps")


class AlgorithmChoice:
    """The algorithm and its settings as given (``hierarchical`` None: decided per model)."""

    def __init__(self, name=GRADIENT_ALLREDUCE, *, source="the policy", **settings):
        if name not in ALGORITHMS:
            raise PolicyError(f"{source}: unknown communication algorithm {name!r}")
        unknown = set(settings) - set(SETTINGS)
        if unknown:
            raise TypeError(f"unknown algorithm setting(s): {', '.join(sorted(unknown))}")
        self.name = name
        self.source = source
        self.settings = {k: v for k, v in settings.items() if v is not None}
        self.explicit_hierarchical = settings.get("hierarchical")
        self._nodes = None     # the world's node count, once some model needed it

    @classmethod
    def from_policy(cls, policy):
        section = policy.algorithm
        return cls(section.name, source=f"policy {policy.source}",
                   **{k: getattr(section, k) for k in SETTINGS})

    @property
    def gradient_only(self):
        """gradient_allreduce or bytegrad: the bucketed allreduce alone, no algorithm object."""
        return self.name in GRADIENT_ALGORITHMS

    def compression(self, configured):
        """The allreduce's compression: bytegrad's 8 bits, else ``configured`` (the policy's)."""
        return "minmax_uint8" if self.name == BYTEGRAD else configured

    def allreduce_options(self, options, group, device):
        """The bucketed allreduce's options for one model: bytegrad's compression, and the
        hierarchy this algorithm asks for. A collective over the world when it must count nodes."""
        out = dict(options, compression=self.compression(options["compression"]))
        if self.name != GRADIENT_ALLREDUCE or self.explicit_hierarchical is not None:
            out["hierarchical"] = self._hierarchical(group, device)
        return out

    def build(self, params, group, timeout_seconds=None):
        """The algorithm object for one model (None for the gradient algorithms). A collective:
        every rank of ``group`` calls it together."""
        if self.gradient_only:
            return None
        from . import algorithms     # imported late: the takeover is built while torch is imported
        cls = algorithms.ALGORITHMS[self.name]
        takes = inspect.signature(cls).parameters
        settings = {k: v for k, v in self.settings.items() if k in takes}
        if "hierarchical" in takes:
            device = params[0].device
            settings["hierarchical"] = self._hierarchical(group, device)
            if settings.get("peer_selection_mode") == "shift_one":
                self._check_pairs(settings["hierarchical"], group, device)
        return algorithms.build(self.name, params, group, timeout_seconds=timeout_seconds, **settings)

    def _hierarchical(self, group, device):
        flag = self.explicit_hierarchical
        spans_world = dist.get_world_size(group) == dist.get_world_size()
        if flag and not spans_world:
            raise PolicyError(f"{self.source}: key 'algorithm.hierarchical': true groups ranks by node "
                              "across the whole world, but this DDP model's process group is smaller")
        if flag is None:
            return spans_world and self._node_count(device) > 1
        return bool(flag)

    def _check_pairs(self, hierarchical, group, device):
        """shift_one pairs ranks (or, hierarchically, nodes): an odd number of them cannot pair."""
        from .algorithms.peers import check_even
        n = self._node_count(device) if hierarchical else dist.get_world_size(group)
        try:
            check_even(n, hierarchical)
        except ValueError as e:
            key = "algorithm.hierarchical" if hierarchical else "algorithm.peer_selection_mode"
            raise PolicyError(f"{self.source}: key '{key}': {e}") from None

    def _node_count(self, device):
        """Counted once: each model's build asked up to three times, a collective each. Every rank
        builds the same models in the same order, so every rank counts at the same call."""
        if self._nodes is None:
            self._nodes = node_count(device)
        return self._nodes

    def describe(self):
        return {"name": self.name, **self.settings}


def node_count(device):
    """How many nodes the world's ranks are on. A collective over the world."""
    mine = torch.tensor([node_id()], dtype=torch.int64, device=device)
    every = torch.empty(dist.get_world_size(), dtype=torch.int64, device=device)
    all_gather_into(every, mine)
    return len(set(every.tolist()))


GRADIENT_CHANGES = {
    "none": "nothing: gradients are averaged as DDP averages them",
    "fp16": "gradients travel as float16 (half the bytes); the average differs from DDP's by fp16 rounding",
    "bf16": "gradients travel as bfloat16 (half the bytes); the average differs from DDP's by bf16 rounding",
    "minmax_uint8": ("gradients travel as 8-bit min-max codes in a scatter-gather (a quarter of the bytes); "
                     "the average differs from DDP's by up to a code step per chunk"),
}

# What some algorithms add to their description: rounds of async, the phase of qadam, exchanges.
DETAILS = ("averaging_rounds", "rounds_applied", "rounds_dropped", "state", "phase", "communications")


def describe_algorithm(choice, options, models):
    """The report's word on the algorithm: its name, settings and what it changes, and over the
    models in charge (their report entries) the bytes sent per step and the seconds waited,
    gradient averaging included; for async the averaging rounds, for qadam its phase."""
    out = {"name": choice.name}
    algs = [(m, m["algorithm"]) for m in models if "algorithm" in m]
    running = [(m, a) for m, a in algs if "dropped" not in a]
    if not running:
        out.update(settings={"compression": options["compression"], "hierarchical": options["hierarchical"]},
                   changes=GRADIENT_CHANGES[options["compression"]],
                   steps=max((m["synchronised_steps"] for m in models), default=0),
                   bytes_sent_per_step=sum(m["bytes_sent_per_step"] for m in models),
                   wait_seconds=round(sum(m["wait_seconds"] for m in models), 6))
    else:     # models may run different algorithms (with_bagua): each says its own in ``models``
        first = running[0][1]
        steps = max(a["steps"] for _, a in running)
        sent = sum(a["bytes_sent"] + m["synchronised_steps"] * m["bytes_sent_per_step"] for m, a in running)
        out.update(name=" + ".join(dict.fromkeys(a["algorithm"] for _, a in running)), settings=first["settings"],
                   changes=first["changes"], steps=steps, bytes_sent_per_step=sent // steps if steps else 0,
                   wait_seconds=round(sum(a["wait_seconds"] + m["wait_seconds"] for m, a in running), 6))
        for key in DETAILS:
            if key in first:
                out[key] = sum(a.get(key, 0) for _, a in running) if isinstance(first[key], int) else first[key]
    if any("error" in a for _, a in algs):
        out["errors"] = [a["error"] for _, a in algs if "error" in a]
    if len(running) < len(algs):
        out["not_used"] = [a["dropped"] for _, a in algs if "dropped" in a]
    return out
