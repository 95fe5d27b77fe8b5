"""Every use of a torch private API, or of behaviour that differs between torch releases.

Imported while torch itself may still be importing (the DDP takeover is installed by a hook on
``torch.nn.parallel.distributed``'s import): nothing of torch is touched until a function runs.

autopatch hooks into torch below its public surface in a few places: the wrapper ``Optimizer``
puts around each class's ``step``, DDP's reducer settings, dynamo's counters and settings, DTensor's
local shard, the autograd engine's end-of-backward callback. Those can change in any release, so
nothing else in autopatch touches them: the rest of the code asks this module, and the
architecture test (tests/test_architecture.py) fails on a private attribute read anywhere else.

Each entry of ``INTERNALS`` names what it uses, the torch releases it was checked on, and its
fallback: what autopatch does where the internal is missing or behaves otherwise (a feature left
off with the reason in the report, never a crash or a silent difference). ``warn_if_untested()``
(called when the runtime first sees torch) warns once on a torch outside ``TESTED``, and
``torch_report()`` says in the report which internals are missing.
"""

import sys
import warnings
from dataclasses import dataclass

import torch

# Releases the version matrix (tools/torch_matrix.py) ran the test suite on; README "Torch versions".
TESTED = ("2.7", "2.11", "2.13", "2.14", "2.15")
FLOOR = (2, 7)     # the first release with every internal below as autopatch uses it


@dataclass(frozen=True)
class Internal:
    name: str
    uses: str           # the private API or version-dependent behaviour
    fallback: str       # what autopatch does without it
    checked_on: tuple = TESTED


def release():
    """torch's (major, minor), from ``torch.__version__`` ("2.13.0+cpu")."""
    parts = torch.__version__.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


# -- the optimizer's step wrapper ---------------------------------------------------------------
STEP_WRAPPER = Internal(
    "optimizer step wrapper",
    "Optimizer.__init__ wraps each class's step once with profile_hook_step, marking it `hooked` and "
    "keeping the original as `__wrapped__`; the wrapper's frames hold `self`",
    "an optimizer whose step is not wrapped cannot be stepped a few chunks at a time: backward and "
    "forward are refused for it with the reason, and multi_layer steps it through its own step()")

_step_wrapper_code = []     # the code object of torch's step wrapper, once asked for


def _wrapper_code():
    if not _step_wrapper_code:
        _step_wrapper_code.append(torch.optim.Optimizer.profile_hook_step(lambda *a: None).__code__)
    return _step_wrapper_code[0]


def unhooked_step(opt_or_class):
    """The class's step function under torch's hook wrapper, or None when it is not wrapped."""
    cls = opt_or_class if isinstance(opt_or_class, type) else type(opt_or_class)
    step = cls.step
    if getattr(step, "hooked", False):
        return getattr(step, "__wrapped__", None)
    return None


def step_wrapper_code():
    """The code object every optimizer class's wrapped ``step()`` runs (a step in flight)."""
    return _wrapper_code()


def nested_step_call(opt):
    """True when a step() of ``opt`` is running inside another step() of ``opt`` (a subclass
    whose step calls ``super().step()`` runs torch's wrapper twice: only the outer call is the
    user's step). Looks two wrapper frames up from the caller's caller."""
    frame, seen, code = sys._getframe(2), 0, _wrapper_code()
    while frame is not None:
        if frame.f_code is code and frame.f_locals.get("self") is opt:
            seen += 1
            if seen == 2:
                return True
        frame = frame.f_back
    return False


OPTIMIZER_HOOKS = Internal(
    "optimizer hook dictionaries",
    "Optimizer keeps its per-instance hooks in _optimizer_step_pre_hooks and five more dicts, and "
    "the global ones in torch.optim.optimizer._global_optimizer_pre_hooks / _post_hooks",
    "a copy of an optimizer (the probe's) could carry the user's hooks: the probe is not run and "
    "the class is not fused, with the reason")

_HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
               "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
               "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


def hook_dicts(opt):
    """The optimizer's own hook dictionaries (those it has)."""
    return [getattr(opt, name) for name in _HOOK_DICTS if hasattr(opt, name)]


def global_step_pre_hooks():
    """The dict of hooks ``register_optimizer_step_pre_hook`` registers in, as it is now."""
    return sys.modules["torch.optim.optimizer"]._global_optimizer_pre_hooks


def ran_optimizer_init(obj):
    """True when ``obj`` went through ``Optimizer.__init__`` (wrappers such as accelerate's
    AcceleratedOptimizer never did)."""
    return hasattr(obj, _HOOK_DICTS[0])


def wrapped_optimizer(obj):
    """The optimizer a wrapper (Lightning's LightningOptimizer) steps, or None."""
    inner = getattr(obj, "_optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


class global_optimizer_hooks_silenced:
    """``with global_optimizer_hooks_silenced():`` the hooks registered with
    ``register_optimizer_step_pre_hook`` / ``_post_hook`` do not fire (autopatch's own steps of
    throw-away copies are not the user's steps); they are all back afterwards. The module's
    dictionaries are swapped for empty ones, never emptied: a user's step that is iterating them
    (autopatch adopts an optimizer from a global pre-hook) goes on undisturbed."""

    def __enter__(self):
        self._module = sys.modules["torch.optim.optimizer"]
        self._saved = []
        for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
            hooks = getattr(self._module, name, None)
            if hooks is not None:
                self._saved.append((name, hooks))
                setattr(self._module, name, type(hooks)())
        return self

    def __exit__(self, *exc):
        for name, hooks in self._saved:
            hooks.update(getattr(self._module, name))    # any registered meanwhile are kept
            setattr(self._module, name, hooks)
        return False


# -- the autograd engine ------------------------------------------------------------------------
BACKWARD_END = Internal(
    "end-of-backward callback",
    "torch.autograd.Variable._execution_engine.queue_callback (DDP's own mechanism)",
    "none: every release since 1.x has it, and DDP depends on it")


def at_backward_end(callback):
    """Run ``callback`` once the backward now running is done (call from inside a gradient hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


LOADER_ITERATOR = Internal(
    "DataLoader iterator",
    "torch.utils.data.dataloader._BaseDataLoaderIter: every DataLoader iterator's class, whose "
    "__next__ hands out each batch (the subclasses override _next_data only)",
    "the report's breakdown counts no time waiting for batches: it is left in 'other'")


def loader_iterator_class():
    """The class whose ``__next__`` every DataLoader iterator runs, or None on a torch without it."""
    import torch.utils.data.dataloader as dataloader
    return getattr(dataloader, "_BaseDataLoaderIter", None)


TENSOR_INTERNALS = Internal(
    "tensor bookkeeping",
    "Tensor._version (in-place write counter), Tensor._base (the tensor a view was made from), "
    "Module._parameters (a module's own parameters, without the hooks parameters() runs), "
    "Module._call_impl (the frame of a module call, which tells the watch whose forward runs), "
    "torch._C.DisableTorchFunctionSubclass",
    "none: these are stable across every release checked")


def version_counter(tensor):
    return tensor._version


def view_base(tensor):
    """The tensor ``tensor`` is a view of, or None."""
    return tensor._base


def own_parameters(module):
    """The parameters registered on ``module`` itself (not its children), without running
    ``named_parameters()``, which mode forward patches."""
    return [p for p in module._parameters.values() if p is not None]


def module_running(p):
    """True when ``p`` is used inside the forward of a module that owns it: a module call
    (``Module._call_impl``) of such a module is on the Python stack of the caller."""
    code = torch.nn.Module._call_impl.__code__
    frame, depth = sys._getframe(2), 0
    while frame is not None and depth < 200:
        if frame.f_code is code:
            module = frame.f_locals.get("self")
            if module is not None and any(q is p for q in own_parameters(module)):
                return True
        frame, depth = frame.f_back, depth + 1
    return False


def plain_tensors():
    """A context in which tensor subclasses' ``__torch_function__`` is not called: ops on them
    run as on plain tensors and return plain tensors."""
    return torch._C.DisableTorchFunctionSubclass()


def foreach_copy_(dst, src):
    """``dst[i].copy_(src[i])`` for every i, in one foreach kernel where torch has it."""
    copy = getattr(torch, "_foreach_copy_", None)
    if copy is None:
        for d, s in zip(dst, src):
            d.copy_(s)
    else:
        copy(dst, src)


# -- compiled code ---------------------------------------------------------------------------------
DYNAMO = Internal(
    "dynamo",
    "torch._dynamo.utils.counters['stats']['unique_graphs'], torch._dynamo.config "
    "(force_parameter_static_shapes, fail_on_recompile_limit_hit, recompile_limit, called "
    "cache_size_limit before 2.7; fail_on_recompile_limit_hit from 2.7), the _torchdynamo_disable "
    "mark on Optimizer._init_group",
    "the compiled route (policy fast) is not used: chunks step through torch's fused kernels or "
    "bitwise, with the reason")


def is_compiling():
    """True while dynamo traces the code that calls this."""
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return compiler.is_compiling()
    return torch._dynamo.is_compiling()


def dynamo_available():
    """Why the compiled route cannot run on this torch, or None."""
    try:
        import torch._dynamo.config as config
        from torch._dynamo.utils import counters  # noqa: F401
    except Exception as e:
        return f"torch._dynamo is unavailable ({type(e).__name__})"
    for name in ("force_parameter_static_shapes", "fail_on_recompile_limit_hit"):
        if not hasattr(config, name):
            return f"torch {torch.__version__}'s dynamo has no setting {name}"
    return None


_own_graphs = [0]     # graphs autopatch compiled itself (the compiled route), not the program


def count_own_graphs(n):
    _own_graphs[0] += n


def user_compiled():
    """True once the program has compiled code with torch.compile (graphs autopatch compiled for
    its own compiled route do not count). Never imports dynamo."""
    utils = sys.modules.get("torch._dynamo.utils")
    return utils is not None and utils.counters["stats"]["unique_graphs"] > _own_graphs[0]


def graphs_compiled():
    """How many graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def compile_settings():
    """dynamo's settings for the compiled route: dynamic chunk lengths, and an error instead of
    a silent eager fallback at the recompile limit."""
    return torch._dynamo.config.patch(force_parameter_static_shapes=False, fail_on_recompile_limit_hit=True)


def recompile_limit():
    config = torch._dynamo.config
    return getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", None)


def hit_recompile_limit(error):
    """dynamo's error at its recompile limit (CacheLimitExceeded before 2.6)."""
    return type(error).__name__ in ("FailOnRecompileLimitHit", "CacheLimitExceeded")


def traceable(function):
    """``function`` without dynamo's "do not trace" mark, which torch puts on
    ``Optimizer._init_group`` (dynamo handles an Optimizer's own; a stand-in must trace it)."""
    import inspect
    if getattr(function, "_torchdynamo_disable", False):
        return inspect.unwrap(function)
    return function


FUSED_KERNELS = Internal(
    "fused optimizer kernels",
    "torch.utils._foreach_utils._get_fused_kernels_supported_devices",
    "torch's fused kernels are taken as available on CUDA only")


def fused_kernel_devices():
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return ["cuda"]
    return _get_fused_kernels_supported_devices()


# -- sharded parameters ---------------------------------------------------------------------------
DTENSOR = Internal(
    "DTensor",
    "torch.distributed.tensor.DTensor (torch.distributed._tensor before 2.5) and its _local_tensor, "
    "which is what to_local() returns under no_grad; FSDP1 marks its parameters _is_flat_param / "
    "_fsdp_flattened",
    "none needed: without the class no parameter is a DTensor; to_local() stands in for _local_tensor")

_dtensor = []     # the DTensor class, once a program has imported it


def _dtensor_class():
    if not _dtensor:
        for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
            cls = getattr(sys.modules.get(name), "DTensor", None)
            if cls is not None:
                _dtensor.append(cls)
                break
    return _dtensor[0] if _dtensor else None


def is_dtensor(t):
    """True for a DTensor. A program holding one has imported torch.distributed.tensor already,
    so a program without one never pays for that import."""
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def local_tensor(t):
    local = getattr(t, "_local_tensor", None)
    return t.to_local() if local is None else local


def dtensor_like(local, ref):
    """A DTensor over ``local`` with ``ref``'s mesh, placements, shape and stride."""
    return _dtensor_class().from_local(local, ref.device_mesh, ref.placements, run_check=False,
                                       shape=ref.shape, stride=ref.stride())


def fsdp1_flat(p):
    """Why FSDP1 manages ``p``'s data itself, or None."""
    if getattr(p, "_is_flat_param", False):
        return "FSDP1 FlatParameter: FSDP swaps its data at every forward"
    if getattr(p, "_fsdp_flattened", False):
        return "FSDP1 use_orig_params view: FSDP re-points it at every forward"
    return None


# -- DistributedDataParallel -----------------------------------------------------------------------
DDP = Internal(
    "DDP reducer settings",
    "DistributedDataParallel._build_params_for_reducer, _join_config, _delay_all_reduce_params, "
    "_use_python_reducer, _comm_hooks, and the private methods that change its reducer "
    "(_register_builtin_comm_hook, _register_fused_optim, _set_static_graph); Parameter "
    "_in_backward_optimizers",
    "the model keeps DDP's own gradient sync, with the reason in the report")

DDP_HANDING_BACK = {
    "register_comm_hook": "a DDP communication hook was registered",
    "_register_builtin_comm_hook": "a DDP communication hook was registered",
    "_register_fused_optim": "an optimizer was fused into DDP's backward",
    "_set_static_graph": "static graph was set",
    "join_hook": "it entered a Join context for uneven inputs, whose hook shadows DDP's own collectives",
}


def ddp_reducer_params(ddp):
    """(the parameters DDP's reducer would average, whether each has a sparse gradient)."""
    return ddp._build_params_for_reducer()


def ddp_unsupported(ddp):
    """Why autopatch must leave this DDP model's reducer alone, from DDP's private settings, or None."""
    needed = ("_build_params_for_reducer", "_join_config")
    missing = [n for n in needed if not hasattr(ddp, n)]
    if missing:
        return f"torch {torch.__version__}'s DDP lacks {', '.join(missing)}"
    if getattr(ddp, "_delay_all_reduce_params", None):
        return "delay_all_reduce_named_params is set"
    if getattr(ddp, "_use_python_reducer", False):
        return "compiled DDP (python reducer) reduces gradients itself"
    if getattr(ddp, "_comm_hooks", None):
        return "a DDP communication hook is registered"
    if ddp._join_config.enable:
        return "it is inside a Join context for uneven inputs"
    return None


def applied_in_backward(p):
    return hasattr(p, "_in_backward_optimizers")


# -- torch.distributed -----------------------------------------------------------------------------
DISTRIBUTED = Internal(
    "torch.distributed details",
    "a group's timeout (ProcessGroup._get_backend(device).options._timeout), the default store "
    "(distributed_c10d._get_default_store), all_gather_single (all_gather_into_tensor before 2.5)",
    "torch's default timeout; node identities exchanged with all_gather_object instead of the store")

def all_gather_into(output, tensor, **kwargs):
    """``output`` gets every rank's ``tensor``: all_gather_single, the current name, or
    all_gather_into_tensor on older torch."""
    import torch.distributed as dist
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, **kwargs)


def group_timeout(group, device):
    """The timeout ``group`` was created with; torch's default where the backend does not say."""
    import torch.distributed as dist
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout


def default_store():
    """The store the default process group was set up with, or None."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    getter = getattr(c10d, "_get_default_store", None)
    if getter is None:
        return None
    try:
        return getter()
    except (RuntimeError, ValueError):
        return None


INTERNALS = (STEP_WRAPPER, OPTIMIZER_HOOKS, BACKWARD_END, LOADER_ITERATOR, TENSOR_INTERNALS, DYNAMO,
             FUSED_KERNELS, DTENSOR, DDP, DISTRIBUTED)

_warned = []


def missing():
    """Internal name -> why it is unusable on this torch, for those that are."""
    out = {}
    optimizer = sys.modules["torch.optim.optimizer"].Optimizer
    if not (hasattr(optimizer, "profile_hook_step") and hasattr(optimizer, "_patch_step_function")):
        out[STEP_WRAPPER.name] = f"torch {torch.__version__} does not wrap Optimizer.step as expected"
    why = dynamo_available()
    if why:
        out[DYNAMO.name] = why
    return out


def tested():
    version = release()
    return f"{version[0]}.{version[1]}" in TESTED


def warn_if_untested():
    """One warning per process on a torch outside the tested releases (torch may still be
    importing: only its version is read)."""
    if not tested() and not _warned:
        _warned.append(True)
        warnings.warn(f"autopatch was not tested on torch {torch.__version__} (tested: {', '.join(TESTED)}); "
                      "it runs, and leaves off whatever needs an internal this torch lacks (see the "
                      "report's torch section)", RuntimeWarning, stacklevel=3)


def torch_report():
    """The report's ``torch`` section: this torch, whether it was tested, what it lacks."""
    out = {"version": torch.__version__, "tested": tested(), "tested_releases": list(TESTED),
           "missing_internals": missing()}
    if release() < FLOOR:
        out["note"] = f"older than the declared floor {FLOOR[0]}.{FLOOR[1]}"
    return out
