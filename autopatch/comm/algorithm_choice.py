"""Which communication algorithm a DDP model gets, and with which settings, from the policy.

The policy's ``algorithm`` section names it with Bagua's arguments. ``gradient_allreduce`` and
``bytegrad`` are settings of the bucketed allreduce (bytegrad: 8-bit min-max compression); the
others are objects of ``comm/algorithms/``, built per model with the settings the policy declares
for that algorithm (``policy.algorithm_settings``; a setting it does not take is left out, and
None leaves the algorithm's own default).

``hierarchical: null`` means hierarchical when the job spans several nodes, as the job's topology
says (autopatch/topology.py). For ``gradient_allreduce`` it leaves ``allreduce.hierarchical`` in
charge, so the default stays DDP's arithmetic. Settings that cannot work with this world
(``shift_one`` with an odd number of participants, ``hierarchical`` over a group smaller than the
world) are a ``PolicyError`` raised where the model is built, on every rank alike, before any step.
"""

import dataclasses

import torch.distributed as dist

from ..policy import PolicyError, algorithm_settings, check_algorithm_name, check_algorithm_setting
from ..topology import topology, why_not_hierarchical
from ..vocabulary import BYTEGRAD, GRADIENT_ALGORITHMS, GRADIENT_ALLREDUCE


class AlgorithmChoice:
    """The algorithm and its settings as given (``hierarchical`` None: decided per model)."""

    def __init__(self, name=GRADIENT_ALLREDUCE, *, source="the policy", **settings):
        self.name = check_algorithm_name(name, source)
        self.source = source
        self.settings = {k: check_algorithm_setting(name, k, v, source) for k, v in settings.items()
                         if v is not None and k in algorithm_settings(name)}
        self.explicit_hierarchical = self.settings.get("hierarchical")

    @classmethod
    def from_policy(cls, policy):
        section = policy.algorithm
        return cls(section.name, source=f"policy {policy.source}",
                   **{k: getattr(section, k) for k in algorithm_settings(section.name)})

    @property
    def gradient_only(self):
        """gradient_allreduce or bytegrad: the bucketed allreduce alone, no algorithm object."""
        return self.name in GRADIENT_ALGORITHMS

    def compression(self, configured):
        """The allreduce's compression: bytegrad's 8 bits, else ``configured`` (the policy's)."""
        return "minmax_uint8" if self.name == BYTEGRAD else configured

    def allreduce_settings(self, settings, group):
        """The bucketed allreduce's ``SyncSettings`` for one model: bytegrad's compression, and
        the hierarchy this algorithm asks for."""
        out = dataclasses.replace(settings, compression=self.compression(settings.compression))
        if self.name != GRADIENT_ALLREDUCE or self.explicit_hierarchical is not None:
            out = dataclasses.replace(out, hierarchical=self._hierarchical(group))
        return out

    def build(self, params, group, timeout_seconds=None):
        """The algorithm object for one model (None for the gradient algorithms). A collective:
        every rank of ``group`` calls it together."""
        if self.gradient_only:
            return None
        from . import algorithms     # imported late: the takeover is built while torch is imported
        settings = dict(self.settings)
        if "hierarchical" in algorithm_settings(self.name):
            settings["hierarchical"] = self._hierarchical(group)
            if settings.get("peer_selection_mode") == "shift_one":
                self._check_pairs(settings["hierarchical"], group)
        return algorithms.build(self.name, params, group, timeout_seconds=timeout_seconds, **settings)

    def _hierarchical(self, group):
        flag = self.explicit_hierarchical
        why = why_not_hierarchical(group)
        if flag and why:
            raise PolicyError(f"{self.source}: key 'algorithm.hierarchical': true, but {why}")
        if flag is None:
            return why is None and topology().nodes > 1
        return bool(flag)

    def _check_pairs(self, hierarchical, group):
        """shift_one pairs ranks (or, hierarchically, nodes): an odd number of them cannot pair."""
        from .algorithms.peers import check_even
        n = topology().nodes if hierarchical else dist.get_world_size(group)
        try:
            check_even(n, hierarchical)
        except ValueError as e:
            key = "algorithm.hierarchical" if hierarchical else "algorithm.peer_selection_mode"
            raise PolicyError(f"{self.source}: key '{key}': {e}") from None

    def describe(self):
        return {"name": self.name, **self.settings}


GRADIENT_CHANGES = {
    "none": "nothing: gradients are averaged as DDP averages them",
    "fp16": "gradients travel as float16 (half the bytes); the average differs from DDP's by fp16 rounding",
    "bf16": "gradients travel as bfloat16 (half the bytes); the average differs from DDP's by bf16 rounding",
    "minmax_uint8": ("gradients travel as 8-bit min-max codes in a scatter-gather (a quarter of the bytes); "
                     "the average differs from DDP's by up to a code step per row"),
}

def _changes(compression, models):
    """What the gradient algorithm changes: its compression's word, or where a model sums in
    another order than DDP (more than two ranks), that model's."""
    differs = next((m["changes_results"] for m in models if m.get("changes_results")), None)
    return differs if compression == "none" and differs else GRADIENT_CHANGES[compression]


# What some algorithms add to their description: rounds of async, the phase of qadam, exchanges.
DETAILS = ("averaging_rounds", "rounds_applied", "rounds_dropped", "state", "phase", "communications")


def describe_algorithm(choice, options, models):
    """The report's word on the algorithm: its name, settings and what it changes, and over the
    models in charge (their report entries) the bytes sent per step and the seconds waited,
    gradient averaging included; for async the averaging rounds, for qadam its phase."""
    out = {"name": choice.name}
    algs = [(m, m["algorithm"]) for m in models if "algorithm" in m]
    running = [(m, a) for m, a in algs if "dropped" not in a]
    if not running:       # the bucketed allreduce's own settings, as each model runs them
        effective = models or [options]
        compression = effective[-1]["compression"]
        out.update(settings={"compression": compression, "hierarchical": any(m["hierarchical"] for m in effective)},
                   changes=_changes(compression, models),
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
