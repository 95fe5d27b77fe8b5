"""The running state of an enabled autopatch: its policy, its patches and its optimizers.

Optimizers are adopted when constructed (a wrapper around ``Optimizer.__init__``) and, for those
built before ``enable()``, at their first step since (a global step pre-hook, which runs before the
optimizer's own hooks, so that step is intercepted as any other). An optimizer that never steps
again is never touched: no scan of the process's objects, no garbage taken for live optimizers.
torch itself is never imported early: when it is not loaded yet, the patch waits for
``torch.optim`` to be imported. The same goes for DistributedDataParallel, whose gradient sync the
comm room takes over.
"""

import functools
import time
import weakref

from .. import agreement
from ..patches.ledger import when_imported
from ..patches.optimizer import OptimizerPatch
from ..reporting.sections import ReportSections
from ..steps_in_flight import IN_FLIGHT
from .comm_view import CommView
from .events import Events


class Runtime:
    def __init__(self, policy):
        from ..modes.forward_reads import ForwardReads
        self.policy = policy
        self.optimizer_patch = OptimizerPatch(self.adopt, self._before_step)
        self.controllers = []
        self.events = Events()
        self.forward_reads = ForwardReads(self.flush)   # mode forward's patches, while it runs
        self.sections = ReportSections()
        self.active = False
        self.started = time.perf_counter()
        self.comm = None   # the DDP takeover (comm/), once DistributedDataParallel is imported
        self.comm_view = CommView()   # what every optimizer's controller asks of comm/
        self.gradient_sync = None     # the session's handle on the takeover
        self.data = None   # the data side's patches (data/), when the policy asks for them
        self.loader_waits = None   # the time spent waiting for batches (data/), for the breakdown
        self._by_id = {}
        self._live = weakref.WeakSet()    # the adopted optimizers still alive
        self._detach = lambda: None
        self.sections.add("allreduce", self._describe_collectives)
        self.sections.add("autotune", lambda: {
            "active": False, "reason": "autotune is not available in this version"
            if policy.autotune.enabled else "autotune.enabled is false"})

    def install(self, session):
        from .monitors import attach
        agreement.opened()
        self.active = True
        self._detach = attach(session)   # step timer, TensorBoard, autotune: only when asked
        self._when_imported("torch.optim", self._patch_torch)
        if self.policy.allreduce.enabled is not False:
            self._when_imported("torch.nn.parallel.distributed", self._take_over_ddp)
        if self.policy.logging.breakdown or self.policy.logging.tensorboard_dir:   # as the step timer does
            self._when_imported("torch.utils.data", self._time_batches)
        self._serve_data()

    def _time_batches(self, module):
        """Every DataLoader iterator's ``__next__`` timed, for the report's breakdown."""
        if self.loader_waits is None:
            from ..data.zero_code.loader_waits import LoaderWaits
            self.loader_waits = LoaderWaits()
            self.loader_waits.install()

    def _serve_data(self):
        """The data side (data/), when the policy asks: every DataLoader's map-style dataset
        served through the sample cache, its DistributedSampler balanced."""
        data = self.policy.data
        if not data.wanted:
            self.sections.add("data", lambda: {"active": False, "reason": "data.cache and data.load_balance are off"})
            return
        from ..data.zero_code.patches import DataPatches
        patches = DataPatches(cache=data.cache_backend, name=data.cache_name, capacity=data.cache_capacity,
                              path=data.cache_path, balance=data.load_balance)
        patches.install()
        self.data = patches
        self.sections.add("data", lambda: dict(patches.describe(), active=True))

    def _when_imported(self, name, patch):
        """``patch(module)`` now if ``name`` is imported, else right after its import (a disabled
        runtime ignores the import: hooks on imports cannot be unregistered)."""
        when_imported(name, patch, still_wanted=lambda: self.active)

    def _patch_torch(self, optim):
        from ..torch_internals import torch_report, warn_if_untested
        if self.optimizer_patch.installed:
            return
        warn_if_untested()
        self.sections.add("torch", torch_report)
        self.optimizer_patch.install(optim)

    @staticmethod
    def _is_wrapper(obj):
        """Wrappers such as accelerate's AcceleratedOptimizer (never ran Optimizer.__init__) or
        Lightning's LightningOptimizer (copies the wrapped optimizer's __dict__, hook dicts
        included) step the optimizer they wrap, which is adopted by itself."""
        from ..torch_internals import ran_optimizer_init, wrapped_optimizer
        return not ran_optimizer_init(obj) or wrapped_optimizer(obj) is not None

    def _take_over_ddp(self, module):
        """DDP models built from now on (and live ones) get autopatch's bucketed allreduce, or
        the policy's communication algorithm, which hears of every optimizer step, where the
        policy asks for them (comm/sync_owner.py); else DDP keeps its own sync."""
        from ..comm.algorithm_choice import AlgorithmChoice
        from ..comm.sync_handle import GradientSync
        from ..comm.sync_owner import why_ddp_keeps
        from ..comm.takeover import DDPTakeover
        from ..stand_ins import stands_for
        if self.comm is not None:
            return
        ar = self.policy.allreduce
        comm = DDPTakeover(bucket_bytes=ar.bucket_bytes, compression=ar.compression,
                           hierarchical=ar.hierarchical, timeout_seconds=ar.timeout_seconds,
                           warn=ar.enabled is True, algorithm=AlgorithmChoice.from_policy(self.policy),
                           keeps=functools.partial(why_ddp_keeps, self.policy),
                           stands_for=stands_for)
        self.comm = self.comm_view.takeover = comm
        self.gradient_sync = GradientSync(comm)
        comm.install(module)

    def _describe_collectives(self):
        """The allreduce section; with sharded parameters it says their collectives stay FSDP's."""
        if self.comm is not None:
            section = self.comm.describe()
        elif self.policy.allreduce.enabled is False:
            section = {"active": False, "reason": "allreduce.enabled is false"}
        else:
            section = {"active": False, "reason": "DistributedDataParallel was never imported"}
        optimizers = [o for o in (c.optimizer for c in self.controllers) if o is not None]
        if not optimizers:        # nothing sharded to speak of (and torch may not be imported at all)
            return section
        from ..reporting.sharded_params import note_collectives
        return note_collectives(section, optimizers)

    def _before_step(self, opt, args, kwargs):
        """An optimizer built before enable() is adopted as its first step since begins.

        The step is a region already (steps_in_flight.py), and a pending toggle is waited for
        here, first: an adoption never runs beside a disable(), and a toggle that removes the
        optimizer's own step hooks does so before torch iterates them (removing one while torch
        iterates them, with a hook of the program's after it, would end that step in
        'OrderedDict mutated during iteration')."""
        if IN_FLIGHT.pending:
            IN_FLIGHT.entering()
        ctrl = self._by_id.get(id(opt))
        if ctrl is None or ctrl.optimizer is not opt:    # controller_of(), inline: every step runs it
            self.taken_in(opt)

    def taken_in(self, opt):
        """``opt``'s handle, adopting it now if it was built before enable() and has not stepped
        since (the program asks for it, or it steps); None for a wrapper of another optimizer."""
        ctrl = self.controller_of(opt)
        if ctrl is None and self.active and not self._is_wrapper(opt):
            ctrl = self.adopt(opt)
        return ctrl

    @IN_FLIGHT.region
    def adopt(self, opt):
        """Put ``opt`` under autopatch (once); returns its handle, or None once uninstalled. A
        region (steps_in_flight.py): disable() never finds an optimizer half adopted."""
        from ..modes.controller import OptimizerController
        if not self.active:
            return None
        ctrl = self.controller_of(opt)
        if ctrl is None:
            sharing = self._sharing(opt)
            ctrl = OptimizerController(opt, self.policy, self.events, self.forward_reads, self.comm_view)
            self._by_id[id(opt)] = ctrl
            self.controllers.append(ctrl)
            self._live.add(opt)
            for other in sharing:
                other.shares_parameters(ctrl.qualname)
                ctrl.shares_parameters(other.qualname)
        return ctrl

    def _sharing(self, opt):
        """The live optimizers' controllers that step some of ``opt``'s parameters (a user who
        re-creates an optimizer and keeps the old one, or loads one's state into another)."""
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        return [self.controller_of(other) for other in list(self._live)
                if any(id(p) in ids for g in other.param_groups for p in g["params"])]

    def controller_of(self, opt):
        ctrl = self._by_id.get(id(opt))
        return ctrl if ctrl is not None and ctrl.optimizer is opt else None

    @IN_FLIGHT.region
    def flush(self):
        """Apply every deferred update now (mode forward); harmless in other modes."""
        for ctrl in self.controllers:
            ctrl.flush()

    def uninstall(self):
        agreement.closed()       # ranks waiting on this one's decisions stop waiting
        self.active = False
        self._detach()
        if self.comm is not None:
            self.comm.remove()
        for ctrl in self.controllers:
            ctrl.release()
        self.forward_reads.close()
        if self.data is not None:
            self.data.uninstall()
        self.optimizer_patch.uninstall()
