"""Module and parameter reads: what mode forward must see before a weight is read.

Targets (wrapped, unless said): ``Module.state_dict``, ``Module.load_state_dict``,
``Module._apply`` (``to()``, ``cpu()``, ``half()``, ...), ``torch.save`` (both names),
``Module.named_parameters``, ``Module.zero_grad``, ``Optimizer.zero_grad``,
``Parameter.__deepcopy__``, ``Module.__getattr__`` (replaced by a plain function: it runs for every
submodule and parameter read in every forward) and torch's global module forward pre-hook.
Internals: ``Module._apply``, the private method every device and dtype move goes through.
"""

import functools

from .ledger import Patch


class ModuleReadsPatch(Patch):
    target = "module_reads"

    def __init__(self, reads):
        """``reads``: mode forward's side (modes/forward_reads.py): ``flush_first``,
        ``each_fresh``, ``without_applying``, ``flush_before_zeroing``, ``fresh_instance``
        (wrapt wrappers), ``before_module(module, args)``, and ``fusions``, the strategies in mode
        forward (each with ``holds_pending(param)`` and ``apply_param(param)``)."""
        self.reads = reads

    def install(self):
        import torch
        reads = self.reads
        section = self._open()
        module, parameter = torch.nn.Module, torch.nn.Parameter
        section.hold(torch.nn.modules.module.register_module_forward_pre_hook(reads.before_module))
        for owner, name in ((module, "state_dict"), (module, "load_state_dict"), (module, "_apply"),
                            (torch, "save"), (torch.serialization, "save")):
            section.wrap(owner, name, reads.flush_first)
        section.wrap(module, "named_parameters", reads.each_fresh)
        section.wrap(module, "zero_grad", reads.without_applying)
        section.wrap(torch.optim.Optimizer, "zero_grad", reads.flush_before_zeroing)
        section.wrap(parameter, "__deepcopy__", reads.fresh_instance)
        section.replace(module, "__getattr__", _fresh_getattr(vars(module)["__getattr__"], reads))


def _fresh_getattr(original, reads):
    """``Module.__getattr__`` whose only extra work is one membership test per optimizer in mode
    forward (benchmarks/bench_forward_reads.py measures it)."""
    from ..torch_internals import is_compiling      # imports torch: installed only once it is loaded

    @functools.wraps(original)
    def __getattr__(module, name):
        value = original(module, name)
        # torch.compile traces this function too: applying an update is no graph operation,
        # so nothing is applied while it compiles.
        for fusion in reads.fusions:
            if fusion.holds_pending(value) and not is_compiling():
                fusion.apply_param(value)
        return value
    return __getattr__
