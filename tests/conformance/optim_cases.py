"""The optimizer variants under test, generated from torch's own optimizer database.

``torch.testing._internal.common_optimizers.optim_db`` lists every optimizer torch ships with its
documented constructor inputs (``optim_inputs_func``), the implementations it supports
(``supported_impls``, ``supports_fused_on``), whether it takes complex parameters or sparse
gradients, whether its step needs a closure, and the tests torch itself skips for it. A variant here
is one OptimizerInfo x one of its CPU inputs x one implementation (for-loop, ``foreach=True``,
``fused=True`` where torch has a fused CPU kernel) x one kind of parameter (dense, complex,
non-contiguous views, sparse gradients) x the learning rate as given or as a tensor. Nothing is
listed by hand, so an optimizer torch adds is covered by itself.

A variant torch itself rejects on CPU (it raises building or stepping it, unpatched) is not a case;
a combination torch's own suite skips on CPU (an active skip or expected failure in the
OptimizerInfo's ``skips``/``decorators``, for the test of torch's that exercises the same thing) is
skipped with torch's reason.
"""

import copy
import functools
import hashlib
import inspect
import sys
import types
import unittest
from dataclasses import dataclass

import torch


def _import_optim_db():
    """``optim_db``, imported without leaving torch's test-suite settings behind.

    torch's testing modules import ``expecttest`` (a test-only dependency, in the ``dev`` extra);
    where it is missing, a module with its one name they use (``TestCase``) stands in. Importing
    them also freezes ``torch.backends`` flags and wraps TorchScript calls for torch's own suite:
    both are put back, so the rest of this test session runs on plain torch.
    """
    try:
        import expecttest  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("expecttest")
        stand_in.TestCase = unittest.TestCase
        sys.modules["expecttest"] = stand_in
    flag = "__allow_nonbracketed_mutation_flag"
    saved_flag = getattr(torch.backends, flag, True)
    saved_calls = (torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__)
    try:
        from torch.testing._internal import common_optimizers
    finally:
        setattr(torch.backends, flag, saved_flag)
        torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__ = saved_calls
    return common_optimizers


common_optimizers = _import_optim_db()
optim_db = common_optimizers.optim_db
INFOS = {info.name: info for info in optim_db}
DTYPE = torch.float32
CLIQUEY = ("foreach", "fused", "differentiable")


def stable_hash(*parts):
    """A hash that is the same in every process and Python version (``hash()`` of a str is not)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big")


def cpu_inputs(info):
    """The OptimizerInfo's documented inputs on CPU, freshly built (their tensors are new)."""
    return info.optim_inputs_func(device="cpu", dtype=DTYPE)


def fused_on_cpu(info):
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    return ("fused" in info.supported_impls and "cpu" in info.supports_fused_on
            and "cpu" in _get_fused_kernels_supported_devices())


def impls(info):
    """for-loop always; ``foreach=True`` and ``fused=True`` where the OptimizerInfo supports them.

    torch's ``_get_optim_inputs_including_global_cliquey_kwargs`` leaves ``foreach`` out on CPU
    (torch has no fast foreach kernels there), but ``foreach=True`` runs on CPU all the same and
    a script may ask for it, so it is a variant here. ``differentiable`` is out of scope.
    """
    out = ["forloop"]
    if "foreach" in info.supported_impls:
        out.append("foreach")
    if fused_on_cpu(info):
        out.append("fused")
    return out


def param_kinds(info):
    if info.only_supports_sparse_grads:
        return ["sparse"]
    kinds = ["dense", "noncontig"]
    if info.supports_complex:
        kinds.append("complex")
    if info.supports_sparse:
        kinds.append("sparse")
    return kinds


@dataclass(frozen=True)
class Variant:
    optim: str          # OptimizerInfo name (the class name)
    input_index: int    # into cpu_inputs(info)
    input_desc: str
    impl: str           # forloop | foreach | fused
    kind: str           # dense | noncontig | complex | sparse
    lr: str             # given | tensor

    @property
    def info(self):
        return INFOS[self.optim]

    @property
    def id(self):
        desc = self.input_desc.replace(" ", "_").replace(",", "").replace("/", "")
        return f"{self.optim}-{desc}-{self.impl}-{self.kind}" + ("-tensor_lr" if self.lr == "tensor" else "")

    def kwargs(self):
        """Fresh constructor kwargs (never shared between runs: schedulers write a tensor lr in place)."""
        info = self.info
        kw = copy.deepcopy(cpu_inputs(info)[self.input_index].kwargs)
        for flag in CLIQUEY:
            if flag in info.supported_impls:
                kw[flag] = False
        if self.impl in ("foreach", "fused"):
            kw[self.impl] = True
        if self.lr == "tensor":
            kw["lr"] = torch.tensor(float(kw.get("lr", default_lr(info.optim_cls))))
        return kw

    def build(self, params, **overrides):
        kw = self.kwargs()
        kw.update(overrides)
        return self.info.optim_cls(params, **kw)

    @property
    def needs_closure(self):
        return self.info.step_requires_closure

    @property
    def matrix_only(self):
        """Muon takes 2-D parameters only (torch's tests give it 2-D ones)."""
        return self.optim == "Muon"


def default_lr(cls):
    p = inspect.signature(cls.__init__).parameters.get("lr")
    return 1e-3 if p is None or p.default is inspect.Parameter.empty else p.default


def variants(info):
    """Every variant of one OptimizerInfo, in a fixed order."""
    out = []
    for i, inp in enumerate(cpu_inputs(info)):
        lr_given = inp.kwargs.get("lr")
        lrs = ["given"] if isinstance(lr_given, torch.Tensor) else ["given", "tensor"]
        for impl in impls(info):
            for kind in param_kinds(info):
                for lr in lrs:
                    out.append(Variant(info.name, i, inp.desc, impl, kind, lr))
    return out


# -- torch's own skips ----------------------------------------------------------------------------
# The test of torch's (TestOptimRenewed) that exercises the same thing as a scenario or a variant;
# where the OptimizerInfo skips one of them on CPU, the case is skipped with torch's reason.
SCENARIO_TESTS = {
    "plain": ("test_forloop_goes_right_direction",),
    "add_group": ("test_param_groups_lr", "test_param_groups_weight_decay"),
    "state_dict": ("test_state_dict_deterministic", "test_can_load_from_to_named_state_dict"),
    "deepcopy": ("test_deepcopy_copies_all_public_attrs",),
    "hooks": ("test_step_pre_hook", "test_step_post_hook", "test_step_all_hooks"),
    "scheduler": ("test_param_group_with_lrscheduler_goes_right_direction",),
    "swa": ("test_forloop_goes_right_direction",),
    "recreate": ("test_forloop_goes_right_direction",),
    "two_optimizers": ("test_forloop_goes_right_direction",),
    "user_mode": ("test_forloop_goes_right_direction",),
}
IMPL_TESTS = {"foreach": ("test_foreach_matches_forloop",), "fused": ("test_fused_matches_forloop",)}
KIND_TESTS = {"complex": ("test_complex", "test_complex_2d"), "sparse": ("test_rosenbrock_sparse",)}
LR_TESTS = {"tensor": ("test_tensor_lr",)}


def _decorator_outcome(decorator):
    """What torch's decorator does to a test here: None (it runs), else why it does not."""
    if getattr(decorator, "__name__", "") == "expectedFailure" or decorator is unittest.expectedFailure:
        return "torch expects this test to fail"

    def probe_test(*args, **kwargs):
        return "ran"
    try:
        wrapped = decorator(probe_test)
    except unittest.SkipTest as e:
        return f"skipped by torch: {e}"
    except Exception:
        return None          # not a skip (tolerance overrides and the like)
    if getattr(wrapped, "__unittest_skip__", False):
        return f"skipped by torch: {getattr(wrapped, '__unittest_skip_why__', '')}"
    if getattr(wrapped, "__unittest_expecting_failure__", False):
        return "torch expects this test to fail"
    try:
        wrapped()
    except unittest.SkipTest as e:
        return f"skipped by torch: {e}"
    except Exception:
        return None
    return None


@functools.lru_cache(maxsize=None)
def torch_skip(variant, scenario):
    """torch's reason for skipping the corresponding tests of its own on CPU, or None."""
    names = (SCENARIO_TESTS.get(scenario, ()) + IMPL_TESTS.get(variant.impl, ())
             + KIND_TESTS.get(variant.kind, ()) + LR_TESTS.get(variant.lr, ()))
    info = variant.info
    params = {"optim_info": info, "dtype": DTYPE}
    for name in names:
        for decorator in info.get_decorators("TestOptimRenewed", name, "cpu", DTYPE, params):
            why = _decorator_outcome(decorator)
            if why:
                return f"{name}: {why}"
    return None


@functools.lru_cache(maxsize=None)
def torch_rejects(variant):
    """Why torch itself refuses this variant on CPU (building it or one step over the scripts'
    model raises), or None."""
    from .scenarios import Net
    try:
        net = Net(variant, seed=0)
        opt = variant.build(net.parameters())
        net.train_step([opt], variant.needs_closure)
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    return None
