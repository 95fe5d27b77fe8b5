"""Mode forward: every public way torch offers to read a weight sees its pending update applied.

Mode forward leaves each chunk's update pending from ``step()`` until its module's next forward.
A read in between would see the weight before that update, so while forward fusion is active
(the patches: patches/module_reads.py):

- whole-model reads apply every pending update first: module ``state_dict()`` and
  ``load_state_dict()``, ``torch.save``, and ``Module._apply`` (``to()``, ``cpu()``, ``cuda()``,
  ``half()``, ``float()``, ``double()``, ``type()``, ...); the optimizer's own ``state_dict()``
  and ``load_state_dict()`` flush through the controller's hooks;
- reads of one parameter apply just the chunk holding it: ``Module.__getattr__``
  (``model.fc.weight``, ``get_parameter()``, a weight shared by another module's forward),
  ``named_parameters()``/``parameters()`` (each parameter as the iterator yields it, so
  ``next(model.parameters()).device`` applies one chunk, not all) and ``Parameter.__deepcopy__``
  (``copy.deepcopy(model)``). Pickling needs nothing more: torch pickles a tensor's storage
  through ``torch.save``.

``zero_grad()`` (module or optimizer) with ``set_to_none=True`` only drops references to grads
that mode forward holds itself since ``step()``: it applies nothing, so a loop calling it between
``step()`` and the next forward (as Hugging Face's Trainer does) keeps its updates deferred. With
``set_to_none=False`` it would zero those very grads, so every pending update is applied first.

Not covered, because nothing cheap sees it: a parameter held in a variable (or reached through
``optimizer.param_groups`` or ``module._parameters``) and read after ``step()`` before its module
runs. Mode auto's watch (watch.py) rules mode forward out when the first steps show such a read.
"""

import threading

from ..patches.module_reads import ModuleReadsPatch


class ForwardReads:
    """The module pre-hook and the read patches, installed while some optimizer runs mode forward:
    no module call or attribute read pays for them otherwise (mode auto tries forward for a few
    steps while it measures). Built at ``enable()``, which may come before torch is imported:
    torch is imported only once something runs mode forward."""

    def __init__(self, flush):
        self.fusions = ()          # the strategies in mode forward; replaced, never changed in
                                   # place, as applying may free an optimizer and untrack it
        self.flush = flush         # applies every pending update
        self.local = threading.local()
        self._patch = ModuleReadsPatch(self)

    def track(self, strategy):
        """``strategy`` runs mode forward from now on."""
        if strategy not in self.fusions:
            self.fusions += (strategy,)
        if not self._patch.installed:
            self._patch.install()

    def untrack(self, strategy):
        self.fusions = tuple(f for f in self.fusions if f is not strategy)
        if not self.fusions:
            self.close()

    def close(self):
        self._patch.uninstall()

    # -- what the patches call (patches/module_reads.py) -----------------------------------------
    def before_module(self, module, args):
        for fusion in self.fusions:
            if fusion.has_pending():
                fusion.apply_for(module)

    def fresh(self, param):
        """Apply the pending chunk holding ``param``, in whichever optimizer holds it."""
        for fusion in self.fusions:
            if fusion.holds_pending(param):
                fusion.apply_param(param)

    def flush_first(self, wrapped, instance, args, kwargs):
        if self.fusions:
            self.flush()
        return wrapped(*args, **kwargs)

    def fresh_instance(self, wrapped, instance, args, kwargs):
        self.fresh(instance)
        return wrapped(*args, **kwargs)

    def each_fresh(self, wrapped, instance, args, kwargs):
        items = wrapped(*args, **kwargs)
        if getattr(self.local, "grads_only", False):
            return items
        return self._freshened(items)

    def _freshened(self, items):
        for name, param in items:
            self.fresh(param)
            yield name, param

    def flush_before_zeroing(self, wrapped, instance, args, kwargs):
        if self.fusions and not kwargs.get("set_to_none", args[0] if args else True):
            self.flush()
        return wrapped(*args, **kwargs)

    def without_applying(self, wrapped, instance, args, kwargs):
        if self.fusions and not kwargs.get("set_to_none", args[0] if args else True):
            self.flush()
        outer = getattr(self.local, "grads_only", False)
        self.local.grads_only = True
        try:
            return wrapped(*args, **kwargs)
        finally:
            self.local.grads_only = outer
