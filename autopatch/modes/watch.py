"""Mode auto's watch over the first steps of an optimizer: which fusion modes cannot change results.

Backward fusion is only right when the gradient at the end of a single backward is exactly what
``step()`` uses and nobody looks at grads or weights in between; forward fusion only when no
parameter is read after ``step()`` before its own module runs. Both are checked on the real run:
gradient hooks count backward passes per step, a module forward pre-hook records which parameters'
modules have run, and a ``TorchFunctionMode`` (active only while observing, never inside
``step()``) sees every torch operation that touches a parameter or a gradient.
"""

import weakref

import torch
from torch.overrides import TorchFunctionMode

from ..torch_internals import at_backward_end, is_compiling, own_parameters
from ..vocabulary import BACKWARD

# Attribute access and metadata queries do not read a tensor's values.
_METADATA = {"__get__", "__set__", "size", "dim", "numel", "element_size", "is_floating_point",
             "is_complex", "data_ptr", "untyped_storage", "stride", "storage_offset",
             "is_contiguous", "requires_grad_", "__len__", "__hash__", "_set_grad_enabled"}
# What zero_grad(set_to_none=False) does to a grad: harmless to both modes (backward fusion has
# freed the grads by then; forward fusion applies its pending updates before zeroing).
_ZEROING = {"zero_", "_foreach_zero_", "detach_"}

ACCUMULATION = "several backward passes before one step() (gradient accumulation, or a step skipped by GradScaler)"
DOUBLE_BACKWARD = "backward with create_graph=True"
SPARSE = "sparse gradients"
CLOSURE = "closure-based step()"
GRAD_READ = "gradients used between backward and step() (clipping, GradScaler, logging)"
PARAM_READ_AFTER_BACKWARD = "parameters used between backward and step()"
PARAM_READ_EARLY = "a parameter is used after step() before its own module runs"
COMPILED = "modules run inside torch.compile (a deferred update cannot be applied inside compiled code)"
GRAD_USED_AFTER_STEP = "gradients used after step() (backward fusion frees them inside backward)"
GRAD_WRITE_AFTER_STEP = "gradients changed in place after step() (a deferred update still needs them)"

BACKWARD_BLOCKERS = (ACCUMULATION, DOUBLE_BACKWARD, SPARSE, CLOSURE, GRAD_READ, PARAM_READ_AFTER_BACKWARD,
                     GRAD_USED_AFTER_STEP)
FORWARD_BLOCKERS = (CLOSURE, SPARSE, PARAM_READ_EARLY, GRAD_WRITE_AFTER_STEP, COMPILED)


class _Watch(TorchFunctionMode):
    def __init__(self, observation):
        super().__init__()
        self.observation = observation

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        if name not in _METADATA:
            self.observation.saw(args, kwargs, name)
        return func(*args, **kwargs)


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


class Observation:
    def __init__(self, opt, steps):
        self.steps_wanted = steps
        self.steps = 0
        self.params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        self.param_ids = {id(p) for p in self.params}
        self.findings = {}
        self.got_grad, self.entered, self.grad_ids = set(), set(), set()
        self.stepped_grads = {}   # id -> weakref of the grads step() used, until the next backward
        self.in_backward = self.after_backward = False
        self.watch = None
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self.handles.append(torch.nn.modules.module.register_module_forward_pre_hook(self._on_module))

    @property
    def done(self):
        return self.steps >= self.steps_wanted

    def _note(self, finding):
        self.findings[finding] = self.findings.get(finding, 0) + 1

    def _on_grad(self, p):
        if id(p) in self.got_grad:
            self._note(ACCUMULATION)
        self.got_grad.add(id(p))
        if torch.is_grad_enabled():
            self._note(DOUBLE_BACKWARD)
        if p.grad is not None and p.grad.is_sparse:
            self._note(SPARSE)
        if not self.in_backward:
            self.in_backward = True
            self.stepped_grads = {}
            at_backward_end(self._backward_done)

    def _backward_done(self):
        self.in_backward = False
        self.after_backward = True
        self.grad_ids = {id(p.grad) for p in self.params if p.grad is not None}

    def _on_module(self, module, args):
        if is_compiling():     # dynamo traces this hook while it compiles the model
            self._note(COMPILED)
        self.entered.update(id(p) for p in own_parameters(module))

    def saw(self, args, kwargs, name):
        for t in _tensors(args, kwargs):
            tid = id(t)
            ref = self.stepped_grads.get(tid)
            if ref is not None and ref() is t and name not in _ZEROING:
                self._note(GRAD_USED_AFTER_STEP)
                if name and name.endswith("_") and not name.endswith("__"):
                    self._note(GRAD_WRITE_AFTER_STEP)
            if tid in self.param_ids:
                if self.after_backward:
                    self._note(PARAM_READ_AFTER_BACKWARD)
                elif tid not in self.entered:
                    self._note(PARAM_READ_EARLY)
            elif self.after_backward and tid in self.grad_ids:
                self._note(GRAD_READ)

    def _stop_watch(self):
        if self.watch is not None:
            self.watch.__exit__(None, None, None)
            self.watch = None

    def on_step(self, closure):
        """At step(): close the window that began after the previous step()."""
        self._stop_watch()
        if closure is not None:
            self._note(CLOSURE)
        self.steps += 1

    def on_step_end(self):
        """After step(): watch the next iteration, from its forward to the next step()."""
        self.got_grad.clear()
        self.entered.clear()
        self.grad_ids = set()
        self.stepped_grads = {id(p.grad): weakref.ref(p.grad) for p in self.params if p.grad is not None}
        self.after_backward = False
        if not self.done:
            self.watch = _Watch(self)
            self.watch.__enter__()

    def blockers(self, mode):
        wanted = BACKWARD_BLOCKERS if mode == BACKWARD else FORWARD_BLOCKERS
        return [f for f in wanted if f in self.findings]

    def close(self):
        self._stop_watch()
        for h in self.handles:
            h.remove()
        self.handles = []
