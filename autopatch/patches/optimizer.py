"""torch.optim: every optimizer is adopted when built, and one built before ``enable()`` when it
first steps since.

Targets: ``torch.optim.Optimizer.__init__`` (wrapped) and torch's global optimizer step pre-hook
(``register_optimizer_step_pre_hook``; it runs before the optimizer's own hooks, so that first
step is intercepted as any other). Internals: the global hooks' dict (torch_internals.py's
``global_step_pre_hooks``), where the hook is removed while another thread's step goes through it
(``GlobalPreHook``).
"""

import sys

from ..steps_in_flight import IN_FLIGHT
from .ledger import Patch, building_own_objects


def _inert(opt, args, kwargs):
    return None


_left_inert = []         # (hooks dict, key) of autopatch's entries replaced by _inert, to delete


class GlobalPreHook:
    """torch's handle of autopatch's global step pre-hook, removed without breaking a step that is
    going through the global hooks as it goes.

    A step that began while a toggle was pending waits in this hook (steps_in_flight.py) while
    ``disable()`` runs on another thread, inside torch's loop over the global hooks' OrderedDict:
    deleting the entry then would end that step in "OrderedDict mutated during iteration" as soon
    as a hook of the program's follows it. Then the entry's function is only replaced (in place:
    the loop goes on) by one that does nothing, and deleted at the next removal or installation
    that finds no step open on another thread."""

    def __init__(self, hooks, handle):
        self.hooks, self.key = hooks, handle.id

    def remove(self):
        hooks, key = self.hooks, self.key
        if key not in hooks:
            return
        if next(reversed(hooks)) != key and IN_FLIGHT.open_elsewhere():
            hooks[key] = _inert
            _left_inert.append((hooks, key))
        else:
            del hooks[key]
        GlobalPreHook.purge()

    @staticmethod
    def purge():
        """Delete the entries left inert, once no step is open on another thread."""
        if _left_inert and not IN_FLIGHT.open_elsewhere():
            for hooks, key in _left_inert:
                if hooks.get(key) is _inert:
                    del hooks[key]
            _left_inert.clear()


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
        from ..torch_internals import global_step_pre_hooks     # torch is imported by now
        module = sys.modules[optim.Optimizer.__module__]      # torch.optim.optimizer
        GlobalPreHook.purge()
        handle = module.register_optimizer_step_pre_hook(self._before_step)
        section.hold(GlobalPreHook(global_step_pre_hooks(), handle))

    def _after_init(self, wrapped, instance, args, kwargs):
        wrapped(*args, **kwargs)
        if not building_own_objects():
            self._adopt(instance)
