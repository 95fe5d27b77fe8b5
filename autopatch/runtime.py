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
        self._by_id = {}
        self.active = False
        self.started = time.perf_counter()
        # Report sections other rooms add (allreduce, autotune): name -> callable returning a dict.
        self.sections = {
            "allreduce": lambda: {"active": False, "reason": "bucketed allreduce is not available in this version"},
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

    def _on_torch_optim(self, module):
        if self.active:   # wrapt hooks cannot be unregistered: a disabled runtime ignores it
            self._patch_torch(module)

    def _patch_torch(self, optim):
        if len(self.ledger):
            return
        self.ledger.wrap(optim.Optimizer, "__init__", self._after_init)
        gc.collect()   # adopt live optimizers only, not garbage awaiting collection
        for obj in gc.get_objects():
            # Wrappers that skip Optimizer.__init__ (accelerate's AcceleratedOptimizer) have no
            # hooks of their own; the optimizer they wrap is adopted by itself.
            if issubclass(type(obj), optim.Optimizer) and hasattr(obj, "_optimizer_step_pre_hooks"):
                self.adopt(obj)

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

    def uninstall(self):
        self.active = False
        self._detach()
        for ctrl in self.controllers:
            ctrl.release()
        self.ledger.uninstall()
