"""The session an ``autopatch.enable()`` call opens: the public seam into a running autopatch.

What other code may use, and nothing else: the optimizers' handles (their mode and reason,
lossless switches of mode and chunk size, their report entries), the knobs of the gradient sync
when autopatch runs it, the events (``step``, ``switch``, ``auto``) with removable handles, report
sections, and the report itself. Autotune, ``autopatch.contrib``, the integrations, the tests and
the benchmarks all go through it.
"""

from .runtime import Runtime


class Session:
    def __init__(self, policy):
        self.runtime = Runtime(policy)
        self.policy = policy

    def install(self):
        self.runtime.install(self)

    @property
    def optimizers(self):
        """Every optimizer's handle (modes/controller.py), in the order they were adopted."""
        return list(self.runtime.controllers)

    def optimizer(self, opt):
        """The handle of ``opt`` (adopted now if it was built before enable() and has not stepped
        since); KeyError for what autopatch does not adopt (a wrapper of another optimizer)."""
        ctrl = self.runtime.taken_in(opt)
        if ctrl is None:
            raise KeyError(f"{type(opt).__qualname__} at {id(opt):#x} is not adopted by autopatch")
        return ctrl

    def leave(self, opt, reason):
        """autopatch no longer fuses ``opt``'s steps, and the report says ``reason``
        (``autopatch.contrib.fuse_optimizer`` takes an optimizer over this way); what runs around
        each step (a communication algorithm) goes on."""
        ctrl = self.runtime.taken_in(opt)
        if ctrl is not None:
            ctrl.leave(reason)

    @property
    def served_data(self):
        """True once the data side served a DataLoader (the cache or the balanced sampler)."""
        return self.runtime.data is not None and self.runtime.data.served

    @property
    def data_waits(self):
        """The time spent waiting for batches so far (data/zero_code/loader_waits.py: ``seconds``,
        ``describe()``), or None before ``torch.utils.data`` is imported or with no breakdown."""
        return self.runtime.loader_waits

    @property
    def allreduce(self):
        """The gradient sync's handle (comm/sync_handle.py: its knobs and setters, a model's
        algorithm), or None when DistributedDataParallel was never imported."""
        return self.runtime.gradient_sync

    def subscribe(self, event, fn):
        """Call ``fn`` on every ``event`` (runtime/events.py); returns a handle with ``remove()``."""
        return self.runtime.events.subscribe(event, fn)

    def report_sections(self):
        """Every report section the rooms added, by name."""
        return self.runtime.sections.describe()

    def add_report_section(self, name, describe):
        """The report gains section ``name`` (``describe()`` returns it); returns a handle."""
        return self.runtime.sections.add(name, describe)

    def flush(self):
        self.runtime.flush()

    def report(self, enabled=True):
        from ..reporting.json_report import build_report
        return build_report(self, enabled)

    @property
    def started(self):
        return self.runtime.started
