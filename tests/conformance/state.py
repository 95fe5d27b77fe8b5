"""Comparing two runs bit for bit (or within policy fast's bound), and the global state a run leaves.

Bit for bit means the same bits: floating-point tensors are compared as integers of their width, so
``-0.0`` differs from ``0.0`` and a NaN equals the same NaN (``torch.equal`` says neither).
"""

import copy
import importlib
from collections import OrderedDict

import torch
import torch.optim.lr_scheduler

# torch.optim deletes its submodules' names from its namespace: reach them through the import system
MODULE = importlib.import_module("torch.nn.modules.module")
OPTIMIZER = importlib.import_module("torch.optim.optimizer")

MODULE_HOOK_DICTS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
                     "_global_backward_pre_hooks", "_global_backward_hooks", "_global_module_registration_hooks",
                     "_global_parameter_registration_hooks", "_global_buffer_registration_hooks")
OPTIMIZER_HOOK_DICTS = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
# Classes and modules whose attributes autopatch may patch while enabled; disable() must put back
# every one of them (the same objects, not equal ones).
PATCHABLE = (torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.nn.Parameter,
             torch.optim.lr_scheduler.LRScheduler, torch.autograd.Function)
PATCHABLE_FUNCTIONS = ((torch, "save"), (torch, "load"), (torch.serialization, "save"), (copy, "deepcopy"))


# -- snapshots ------------------------------------------------------------------------------------
def _hook_dicts():
    out = {f"torch.nn.modules.module.{n}": getattr(MODULE, n) for n in MODULE_HOOK_DICTS if hasattr(MODULE, n)}
    out.update({f"torch.optim.optimizer.{n}": getattr(OPTIMIZER, n) for n in OPTIMIZER_HOOK_DICTS})
    return out


def global_state():
    """What a training script could notice: torch's mode stacks and its global hook registries."""
    out = {"torch function modes on the stack": torch._C._len_torch_function_stack(),
           "torch dispatch modes on the stack": torch._C._len_torch_dispatch_stack()}
    out.update({name: len(d) for name, d in _hook_dicts().items()})
    return out


def hook_keys():
    return {name: set(d) for name, d in _hook_dicts().items()}


def grad_hooks(params):
    """(index, how many gradient hooks) of each parameter that has any."""
    out = []
    for i, p in enumerate(params):
        n = len(getattr(p, "_post_accumulate_grad_hooks", None) or ()) + len(getattr(p, "_backward_hooks", None) or ())
        if n:
            out.append((i, n))
    return out


def patchable_objects():
    out = {}
    for cls in PATCHABLE:
        for name, value in vars(cls).items():
            out[f"{cls.__module__}.{cls.__qualname__}.{name}"] = value
    for module, name in PATCHABLE_FUNCTIONS:
        out[f"{module.__name__}.{name}"] = getattr(module, name)
    return out


def _made_by_autopatch(value):
    """A function or wrapper autopatch put there (torch patches some of these classes itself the
    first time it compiles: those are not autopatch's to restore)."""
    seen = 0
    while value is not None and seen < 8:
        module = getattr(type(value), "__module__", "") or ""
        own = getattr(value, "__module__", "") or ""
        if module.startswith(("wrapt", "autopatch")) or (isinstance(own, str) and own.startswith("autopatch")):
            return True
        value = getattr(value, "__wrapped__", None)
        seen += 1
    return False


def changed_objects(before):
    """Attributes of torch's classes that are not the objects they were before and that autopatch
    put there."""
    now = patchable_objects()
    return sorted(k for k in set(before) | set(now)
                  if before.get(k, None) is not now.get(k, None) and _made_by_autopatch(now.get(k, None)))


def restore_globals(before_keys, stack_depth):
    """Take off whatever a run left in torch's global registries and mode stack, so the next test
    starts clean (a leak is reported before this runs)."""
    for name, d in _hook_dicts().items():
        for k in set(d) - before_keys.get(name, set()):
            del d[k]
    while torch._C._len_torch_function_stack() > stack_depth:
        torch._C._pop_torch_function_stack()


# -- copies ---------------------------------------------------------------------------------------
def clone_tree(obj):
    """A deep copy whose tensors are fresh clones (a state_dict shares the optimizer's tensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return type(obj)((k, clone_tree(v)) for k, v in obj.items()) if not isinstance(obj, OrderedDict) \
            else OrderedDict((k, clone_tree(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v) for v in obj)
    return copy.deepcopy(obj)


def raw_state(opt):
    """``opt.state`` by parameter position (group, index), as a script reading it directly sees it,
    plus the number of entries (an entry for something that is not a parameter of ``opt`` shows)."""
    out = {}
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            if p in opt.state:
                out[(gi, pi)] = clone_tree(dict(opt.state[p]))
    out["entries"] = len(opt.state)
    return out


# -- comparing ------------------------------------------------------------------------------------
_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t):
    t = t.detach()
    if t.is_sparse:
        t = t.coalesce()
        return ("sparse", _bits(t.indices()), _bits(t.values()))
    if t.is_complex():
        t = torch.view_as_real(t)
    t = t.contiguous()
    if t.dtype.is_floating_point:
        t = t.view(_INT_OF[t.element_size()])
    return t


def _same_bits(a, b):
    a, b = _bits(a), _bits(b)
    if isinstance(a, tuple) or isinstance(b, tuple):
        return isinstance(a, tuple) and isinstance(b, tuple) and all(_same_bits(x, y) for x, y in zip(a[1:], b[1:]))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _relative(a, b):
    """Largest difference relative to the larger tensor's largest magnitude (as the probe measures)."""
    a, b = a.detach().to_dense() if a.is_sparse else a.detach(), b.detach().to_dense() if b.is_sparse else b.detach()
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    a, b = a.double(), b.double()
    if not a.numel():
        return 0.0
    both_nan = torch.isnan(a) & torch.isnan(b)
    diff = torch.where(both_nan, torch.zeros_like(a), (a - b).abs())
    scale = max(a.abs().nan_to_num().max().item(), b.abs().nan_to_num().max().item())
    d = diff.max().item()
    if d != d:
        return float("inf")
    return d / scale if scale else (0.0 if d == 0 else float("inf"))


class Comparison:
    """Compares nested structures; ``tol`` None means bit for bit, else the largest relative
    deviation allowed per floating-point tensor."""

    def __init__(self, tol=None):
        self.tol = tol
        self.worst = 0.0

    def diff(self, a, b, where):
        """The first difference between ``a`` and ``b`` as text, or None."""
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
                return f"{where}: {type(a).__name__} vs {type(b).__name__}"
            if (a.dtype, a.shape, a.is_sparse) != (b.dtype, b.shape, b.is_sparse):
                return f"{where}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
            if _same_bits(a, b):
                return None
            if a.dtype.is_floating_point or a.is_complex():
                rel = _relative(a, b)
                if self.tol is not None and rel <= self.tol:
                    self.worst = max(self.worst, rel)
                    return None
                return f"{where}: differs by {rel:.3g} relative to its largest magnitude" + \
                       ("" if self.tol is None else f" (allowed {self.tol:.3g})")
            return f"{where}: {a.tolist() if a.numel() < 8 else '...'} vs {b.tolist() if b.numel() < 8 else '...'}"
        if isinstance(a, dict) and isinstance(b, dict):
            if set(a) != set(b):
                return f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
            for k in a:
                d = self.diff(a[k], b[k], f"{where}[{k!r}]")
                if d:
                    return d
            return None
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            if len(a) != len(b):
                return f"{where}: {len(a)} entries vs {len(b)}"
            for i, (x, y) in enumerate(zip(a, b)):
                d = self.diff(x, y, f"{where}[{i}]")
                if d:
                    return d
            return None
        if type(a) is not type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
            return f"{where}: {a!r} vs {b!r}"
        if a != b and not (a != a and b != b):
            if isinstance(a, float) and self.tol is not None and abs(a - b) <= self.tol * max(abs(a), abs(b)):
                return None
            return f"{where}: {a!r} vs {b!r}"
        return None
