"""The watch over an optimizer's first steps: which fusion modes cannot change results.

Backward fusion is only right when the gradient at the end of a single backward is exactly what
``step()`` uses and nobody looks at grads or weights in between; forward fusion only when no
parameter is read after ``step()`` before its own module runs. Both are checked on the real run:
gradient hooks count backward passes per step, and what the run does with the parameters and
their gradients between one ``step()`` and the next is seen on those tensors themselves.

Nothing global is touched, so nothing can be left behind: no torch function mode, no global
module hook. Between one ``step()`` and the next, each watched parameter (and each gradient it
holds) carries a subclass of its own class whose ``__torch_function__`` notes the operation and
runs it as usual, on plain tensors (its results are plain tensors; copies and pickles of it are
of its own class); at every ``step()``, at the end of the watch, at ``disable()`` and when the
optimizer is freed, every tensor gets its own class back. A parameter used inside its own
module's forward is told apart from one used elsewhere by the module call on the Python stack
(``torch_internals.module_running``). Hooks and records hold the parameters and the optimizer
weakly: a dropped optimizer and its model are freed as they would be unpatched.

Compiled code must never meet the subclass (dynamo would guard on it and trace it), so once the
program has compiled anything, the window opens only once backward is over (the user's own code
between backward and ``step()`` runs eagerly) and forward fusion is ruled out, as it would be
anyway: a deferred update cannot be applied inside compiled code.
"""

import functools
import weakref

import torch

from ..torch_internals import at_backward_end, module_running, plain_tensors, user_compiled
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
UNWATCHABLE = "a parameter or gradient of a tensor subclass (the watch cannot follow it)"

BACKWARD_BLOCKERS = (ACCUMULATION, DOUBLE_BACKWARD, SPARSE, CLOSURE, GRAD_READ, PARAM_READ_AFTER_BACKWARD,
                     GRAD_USED_AFTER_STEP, UNWATCHABLE)
FORWARD_BLOCKERS = (CLOSURE, SPARSE, PARAM_READ_EARLY, GRAD_WRITE_AFTER_STEP, COMPILED, UNWATCHABLE)

PARAM, STEPPED_GRAD, GRAD = "param", "stepped grad", "grad"
_watched = {}       # id(tensor) -> (weakref to it, weakref to its Observation, its role)
_classes = {}       # a plain class -> its watched subclass


def _note_use(func, args, kwargs):
    name = getattr(func, "__name__", None)
    if name in _METADATA:
        return
    for t in _tensors(args, kwargs):
        entry = _watched.get(id(t))
        if entry is not None and entry[0]() is t:
            observation = entry[1]()
            if observation is not None:
                observation.saw(t, entry[2], name)


def _torch_function(cls, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    _note_use(func, args, kwargs)
    with plain_tensors():
        return func(*args, **kwargs)


def _as_own_class(method):
    """``method`` of the plain class, run while the tensor has its own class back (copies and
    pickles must never carry the watch's class)."""
    def run(self, *args):
        watched = type(self)
        self.__class__ = watched.__bases__[0]
        try:
            return getattr(self, method)(*args)
        finally:
            self.__class__ = watched
    run.__name__ = method
    return run


def _watched_class(cls):
    if cls not in _classes:
        _classes[cls] = type(f"Watched{cls.__name__}", (cls,), {
            "__torch_function__": classmethod(_torch_function),
            "__deepcopy__": _as_own_class("__deepcopy__"),
            "__reduce_ex__": _as_own_class("__reduce_ex__"),
            "__module__": __name__})
    return _classes[cls]


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _on_grad(ref, p):
    observation = ref()
    if observation is not None:
        observation.on_grad(p)


class Observation:
    def __init__(self, opt, steps):
        self.steps_wanted = steps
        self.steps = 0
        params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        self.params = [weakref.ref(p) for p in params]
        self.param_ids = {id(p) for p in params}
        self.findings = {}
        self.got_grad, self.entered = set(), set()
        self.in_backward = self.after_backward = False
        self.wrapped = []          # weak references to the tensors wrapped in this window
        self.window = False        # between a step() and the next one, while watching
        self.compiled = False      # the program compiles: the window opens at backward's end
        me = weakref.ref(self)
        self.handles = [p.register_post_accumulate_grad_hook(functools.partial(_on_grad, me)) for p in params]
        self._closer = weakref.finalize(opt, self.close)   # a freed optimizer is watched no more

    @property
    def done(self):
        return self.steps >= self.steps_wanted

    def _note(self, finding):
        self.findings[finding] = self.findings.get(finding, 0) + 1

    def _live_params(self):
        return [p for p in (r() for r in self.params) if p is not None]

    # -- the window between two steps -----------------------------------------------------------
    def _wrap(self, t, role):
        cls = type(t)
        if cls not in (torch.Tensor, torch.nn.Parameter):
            if cls not in _classes.values():
                self._note(UNWATCHABLE)
            return
        t.__class__ = _watched_class(cls)
        _watched[id(t)] = (weakref.ref(t), weakref.ref(self), role)
        self.wrapped.append(weakref.ref(t))

    def _unwrap_all(self):
        wrapped, self.wrapped = self.wrapped, []
        for ref in wrapped:
            t = ref()
            if t is not None:
                _watched.pop(id(t), None)
                t.__class__ = type(t).__bases__[0]

    def on_grad(self, p):
        if id(p) in self.got_grad:
            self._note(ACCUMULATION)
        self.got_grad.add(id(p))
        if torch.is_grad_enabled():
            self._note(DOUBLE_BACKWARD)
        if p.grad is not None and p.grad.is_sparse:
            self._note(SPARSE)
        if not self.in_backward:
            self.in_backward = True
            at_backward_end(functools.partial(_backward_done, weakref.ref(self)))

    def backward_done(self):
        self.in_backward = False
        self.after_backward = True
        if not self.window:
            return
        for p in self._live_params():      # the window is open: its new gradients are watched too
            if self.compiled and id(p) not in _watched:
                self._wrap(p, PARAM)
            if p.grad is not None and id(p.grad) not in _watched:
                self._wrap(p.grad, GRAD)

    def saw(self, t, role, name):
        if role == STEPPED_GRAD:
            if name not in _ZEROING:
                self._note(GRAD_USED_AFTER_STEP)
                if name and name.endswith("_") and not name.endswith("__"):
                    self._note(GRAD_WRITE_AFTER_STEP)
        elif role == GRAD:
            if self.after_backward:
                self._note(GRAD_READ)
        elif self.after_backward:
            if not module_running(t):
                self._note(PARAM_READ_AFTER_BACKWARD)
        elif id(t) not in self.entered:
            if module_running(t):
                self.entered.add(id(t))
            else:
                self._note(PARAM_READ_EARLY)

    # -- step boundaries ------------------------------------------------------------------------
    def on_step(self, closure):
        """At step(): close the window that began after the previous step()."""
        self._unwrap_all()
        self.window = False
        if closure is not None:
            self._note(CLOSURE)
        self.steps += 1

    def on_step_end(self):
        """After step(): watch the next iteration, from its forward to the next step()."""
        self.got_grad.clear()
        self.entered.clear()
        self.after_backward = False
        if self.done:
            return
        self.window = True
        if user_compiled():
            self.compiled = True
            self._note(COMPILED)
            return                     # from backward's end on only
        for p in self._live_params():
            self._wrap(p, PARAM)
            if p.grad is not None:
                self._wrap(p.grad, STEPPED_GRAD)

    def blockers(self, mode):
        wanted = BACKWARD_BLOCKERS if mode == BACKWARD else FORWARD_BLOCKERS
        return [f for f in wanted if f in self.findings]

    def close(self):
        """Every tensor gets its own class back and every hook goes (idempotent)."""
        self._unwrap_all()
        for h in self.handles:
            h.remove()
        self.handles = []
        self._closer.detach()


def _backward_done(ref):
    observation = ref()
    if observation is not None:
        observation.backward_done()

