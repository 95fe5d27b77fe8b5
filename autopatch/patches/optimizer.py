"""torch.optim: every optimizer is adopted when built, and one built before ``enable()`` when it
first steps since.

Targets: ``torch.optim.Optimizer.__init__`` (wrapped) and torch's global optimizer step pre-hook
(``register_optimizer_step_pre_hook``; it runs before the optimizer's own hooks, so that first
step is intercepted as any other). Internals: none.
"""

import sys

from .ledger import Patch, building_own_objects


class OptimizerPatch(Patch):
    target = "optimizer"

    def __init__(self, adopt, before_step):
        """``adopt(opt)`` once an optimizer of the program is built (not the ones autopatch
        builds for itself); ``before_step(opt, args, kwargs)`` before every optimizer's step."""
        self._adopt = adopt
        self._before_step = before_step

    def install(self, optim):
        """Patch ``optim`` (the imported ``torch.optim``), once."""
        if self.installed:
            return
        section = self._open()
        section.wrap(optim.Optimizer, "__init__", self._after_init)
        hooks = sys.modules[optim.Optimizer.__module__]       # torch.optim.optimizer
        section.hold(hooks.register_optimizer_step_pre_hook(self._before_step))

    def _after_init(self, wrapped, instance, args, kwargs):
        wrapped(*args, **kwargs)
        if not building_own_objects():
            self._adopt(instance)
