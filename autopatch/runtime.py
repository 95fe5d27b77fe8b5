"""The running state of an enabled autopatch: its policy, its patches and its optimizers.

Optimizers are adopted when constructed (a wrapper around ``Optimizer.__init__``) and, for those
built before ``enable()``, by a one-time scan of live objects. torch itself is never imported
early: when it is not loaded yet, the patch waits for ``torch.optim`` to be imported.
"""

import gc
import sys
import time

import wrapt

from .patching import Ledger


class Runtime:
    def __init__(self, policy):
        self.policy = policy
        self.ledger = Ledger()
        self.controllers = []
        self.step_listeners = []   # called with the controller after every optimizer step
        self.switch_listeners = []  # called with the controller after each change of its mode
        self.auto_listeners = []   # called with the controller and mode auto's figures, per choice
        self.forward_fusions = set()   # controllers in mode forward, with updates to apply
        self._forward_patches = None   # forward fusion's hook and read patches, while some optimizer needs them
        self._optimizers_patched = False
        self._by_id = {}
        self.active = False
        self.started = time.perf_counter()
        self.comm = None   # the DDP takeover (comm/), once DistributedDataParallel is imported
        # Report sections other rooms add (allreduce, autotune): name -> callable returning a dict.
        self.sections = {
            "allreduce": self._describe_collectives,
            "autotune": lambda: {"active": False, "reason": "autotune is not available in this version"
                                 if policy.autotune.enabled else "autotune.enabled is false"},
        }

    def install(self):
        from .monitors import attach
        self.active = True
        self._detach = attach(self)   # step timer, TensorBoard, autotune: only when asked
        if "torch.optim" in sys.modules:
            self._patch_torch(sys.modules["torch.optim"])
        else:
            wrapt.register_post_import_hook(self._on_torch_optim, "torch.optim")
        if self.policy.allreduce.enabled is not False:
            if "torch.nn.parallel.distributed" in sys.modules:
                self._take_over_ddp(sys.modules["torch.nn.parallel.distributed"])
            else:
                wrapt.register_post_import_hook(self._on_ddp_module, "torch.nn.parallel.distributed")

    def _on_torch_optim(self, module):
        if self.active:   # wrapt hooks cannot be unregistered: a disabled runtime ignores it
            self._patch_torch(module)

    def _patch_torch(self, optim):
        if self._optimizers_patched:
            return
        self._optimizers_patched = True
        self.ledger.wrap(optim.Optimizer, "__init__", self._after_init)
        gc.collect()   # adopt live optimizers only, not garbage awaiting collection
        for obj in gc.get_objects():
            if issubclass(type(obj), optim.Optimizer) and not self._is_wrapper(obj, optim.Optimizer):
                self.adopt(obj)

    @staticmethod
    def _is_wrapper(obj, optimizer_cls):
        """Wrappers such as accelerate's AcceleratedOptimizer (never ran Optimizer.__init__) or
        Lightning's LightningOptimizer (copies the wrapped optimizer's __dict__, hook dicts
        included) step the optimizer they wrap, which is adopted by itself."""
        return (not hasattr(obj, "_optimizer_step_pre_hooks")
                or isinstance(getattr(obj, "_optimizer", None), optimizer_cls))

    def _on_ddp_module(self, module):
        if self.active:
            self._take_over_ddp(module)

    def _take_over_ddp(self, module):
        """DDP models built from now on (and live ones) get autopatch's bucketed allreduce."""
        from .comm.takeover import DDPTakeover
        if self.comm is not None:
            return
        ar = self.policy.allreduce
        self.comm = DDPTakeover(bucket_bytes=ar.bucket_bytes, compression=ar.compression,
                                hierarchical=ar.hierarchical, timeout_seconds=ar.timeout_seconds,
                                warn=ar.enabled is True)
        self.comm.install(module)

    def _describe_collectives(self):
        """The allreduce section; with sharded parameters it says their collectives stay FSDP's."""
        from .sharded import note_collectives
        return note_collectives(self, self._describe_allreduce())

    def _describe_allreduce(self):
        if self.comm is not None:
            return self.comm.describe()
        if self.policy.allreduce.enabled is False:
            return {"active": False, "reason": "allreduce.enabled is false"}
        return {"active": False, "reason": "DistributedDataParallel was never imported"}

    def _after_init(self, wrapped, instance, args, kwargs):
        wrapped(*args, **kwargs)
        self.adopt(instance)

    def adopt(self, opt):
        from .controller import OptimizerController
        if id(opt) in self._by_id and self._by_id[id(opt)].ref() is opt:
            return
        ctrl = OptimizerController(self, opt)
        self._by_id[id(opt)] = ctrl
        self.controllers.append(ctrl)

    def enable_forward_fusion(self, ctrl):
        """Mode forward needs to see every module's forward and every way weights are read."""
        self.forward_fusions.add(ctrl)
        if self._forward_patches is not None:
            return
        import torch
        from .forward_reads import ForwardReads
        patches = Ledger()
        patches.hold(torch.nn.modules.module.register_module_forward_pre_hook(self._before_module))
        ForwardReads(self.forward_fusions, self.flush).install(patches)
        self._forward_patches = patches

    def disable_forward_fusion(self, ctrl):
        """An optimizer left mode forward: with none left, the hook and the read patches go, so
        no module call or attribute read pays for them (mode auto tries forward for a few steps
        while it measures)."""
        self.forward_fusions.discard(ctrl)
        if not self.forward_fusions and self._forward_patches is not None:
            self._forward_patches.uninstall()
            self._forward_patches = None

    def _before_module(self, module, args):
        for ctrl in self.forward_fusions:
            if ctrl.strategy.has_pending:
                ctrl.strategy.apply_for(module)

    def flush(self):
        """Apply every deferred update now (mode forward); harmless in other modes."""
        for ctrl in self.controllers:
            ctrl.flush()

    def uninstall(self):
        self.active = False
        self._detach()
        if self.comm is not None:
            self.comm.remove()
        for ctrl in self.controllers:
            ctrl.release()
        if self._forward_patches is not None:
            self._forward_patches.uninstall()
            self._forward_patches = None
        self.ledger.uninstall()
