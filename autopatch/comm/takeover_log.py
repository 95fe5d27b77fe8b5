"""What the DDP takeover did per model, kept for the report.

One entry per adopted model: its reducer and algorithm while autopatch is in charge, their last
descriptions once the model is retired (freed, handed back, autopatch disabled); and the models
left to DDP's own reducer, with the reason. Entries outlive the models they describe.
"""

import warnings

import torch.distributed as dist

from .algorithm_choice import describe_algorithm


class TakeoverLog:
    def __init__(self, warn):
        self.warn = warn
        self.entries = []      # per adopted model: its reducer, or once retired its last description
        self.left_to_ddp = []

    def add(self, ddp, reducer, algorithm):
        entry = {"model": type(ddp.module).__name__, "reducer": reducer}
        if algorithm is not None:
            entry["algorithm"] = algorithm
        self.entries.append(entry)
        return entry

    def entry_of(self, reducer):
        return next(e for e in self.entries if e.get("reducer") is reducer)

    def retire(self, entry, why):
        """Stop the model's reducer and close its algorithm; keep only their descriptions."""
        reducer = entry.pop("reducer", None)
        if reducer is not None:
            reducer.remove()
            entry.update(reducer.describe(), ended=why)
        self.close_algorithm(entry)

    def retire_all(self, why):
        for entry in self.entries:
            self.retire(entry, why)

    @staticmethod
    def close_algorithm(entry, why=None):
        """Close the model's algorithm, if one runs; its entry keeps its last description."""
        algorithm = entry.get("algorithm")
        if algorithm is not None and not isinstance(algorithm, dict):
            algorithm.close()
            entry["algorithm"] = dict(algorithm.describe(), **({"dropped": why} if why else {}))

    @staticmethod
    def set_algorithm(entry, algorithm):
        """The model runs ``algorithm`` (None: a gradient algorithm) from now on; close the old one first."""
        entry.pop("algorithm", None)
        if algorithm is not None:
            entry["algorithm"] = algorithm

    def leave(self, ddp, reason):
        """DDP keeps its own gradient sync for ``ddp``; warn on rank 0 when asked to."""
        self.left_to_ddp.append({"model": type(ddp.module).__name__, "reason": reason})
        if self.warn and dist.get_rank() == 0:
            warnings.warn(f"autopatch: {type(ddp.module).__name__} keeps DDP's own gradient sync: {reason}",
                          RuntimeWarning, stacklevel=3)

    def rejoin(self, ddp, reason):
        """``ddp``, left to DDP for ``reason`` until now, is taken over after all."""
        gone = {"model": type(ddp.module).__name__, "reason": reason}
        if gone in self.left_to_ddp:
            self.left_to_ddp.remove(gone)

    def describe(self, choice, options, topology=None):
        """The report's allreduce section: the settings each model runs with (``options`` are the
        policy's, which a model's algorithm or its process group may change), and the nodes."""
        models = [self._describe_entry(e) for e in self.entries]
        in_charge = [m for m in models if not m.get("ended", "").startswith("handed back")]
        if any("ended" not in m for m in models):
            reason = f"averages the gradients of {sum('ended' not in m for m in models)} DDP model(s)"
        elif in_charge:
            reason = f"averaged the gradients of {len(in_charge)} DDP model(s) until {in_charge[-1]['ended']}"
        elif self.left_to_ddp:
            reason = f"DDP keeps its own gradient sync: {self.left_to_ddp[-1]['reason']}"
        else:
            reason = "no DistributedDataParallel model has been built or run since autopatch was enabled"
        effective = in_charge or [options]
        out = {
            "active": bool(in_charge),
            "reason": reason,
            "bucket_bytes": options["bucket_bytes"],
            "buckets": sum(m["buckets"] for m in in_charge),
            "compression": effective[-1]["compression"],
            "hierarchical": any(m["hierarchical"] for m in effective),
            "bytes_sent_per_step": sum(m["bytes_sent_per_step"] for m in in_charge),
            "wait_seconds": round(sum(m["wait_seconds"] for m in models), 6),
            "algorithm": describe_algorithm(choice, options, in_charge),
            "models": models,
            "left_to_ddp": list(self.left_to_ddp),
        }
        if topology is not None:
            out["topology"] = topology.describe()
        return out

    @staticmethod
    def _describe_entry(entry):
        if "reducer" not in entry:
            return dict(entry)
        out = dict(model=entry["model"], **entry["reducer"].describe())
        if "algorithm" in entry:     # the live algorithm, or once dropped its last description
            algorithm = entry["algorithm"]
            out["algorithm"] = algorithm if isinstance(algorithm, dict) else algorithm.describe()
        return out
