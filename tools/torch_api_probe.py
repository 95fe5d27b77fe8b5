#!/usr/bin/env python3
"""Check, in the running interpreter's torch, every private API and version-dependent behaviour
autopatch relies on, so a torch release that renames or changes one is seen before a user's run
degrades to unpatched (or crashes).

Each check names the autopatch code that depends on it. Run by tools/torch_matrix.py in each
venv; alone: ``python tools/torch_api_probe.py [out.json]`` prints a table and writes JSON. It
imports torch only, never autopatch, so a failure here is torch's difference, not autopatch's.
"""

import collections
import inspect
import json
import os
import sys
import tempfile
import traceback
import warnings

import torch

CHECKS = []


def check(name, where):
    """Register a check: a function returning (ok, detail) or raising (not ok)."""
    def register(fn):
        CHECKS.append((name, where, fn))
        return fn
    return register


def params(n=2):
    return [torch.nn.Parameter(torch.randn(3)) for _ in range(n)]


# -- optimizer internals ---------------------------------------------------------------------------

@check("Optimizer.profile_hook_step wrapper code is the class step's",
       "modes/interception.py:18 (_STEP_WRAPPER_CODE), fusion/chunk_step.py:14")
def _():
    opt = torch.optim.AdamW(params())
    code = torch.optim.Optimizer.profile_hook_step(lambda *a: None).__code__
    same = type(opt).step.__code__ is code
    return same, "same code object" if same else "the class's step wrapper has other code"


@check("class step has .hooked and .__wrapped__", "fusion/chunk_step.py:14-15, comm/algorithms/qadam.py:214")
def _():
    opt = torch.optim.AdamW(params())
    step = type(opt).step
    hooked, wrapped = getattr(step, "hooked", None), getattr(step, "__wrapped__", None)
    return bool(hooked) and callable(wrapped), f"hooked={hooked!r}, __wrapped__={'yes' if wrapped else 'no'}"


@check("Optimizer.register_{step_pre,step_post,state_dict_pre,load_state_dict_pre,load_state_dict_post}_hook",
       "modes/interception.py:44-49")
def _():
    names = ["register_step_pre_hook", "register_step_post_hook", "register_state_dict_pre_hook",
             "register_load_state_dict_pre_hook", "register_load_state_dict_post_hook"]
    missing = [n for n in names if not hasattr(torch.optim.Optimizer, n)]
    return not missing, "missing: " + ", ".join(missing) if missing else "all present"


@check("Optimizer instance hook dicts (_optimizer_step_pre_hooks, ...)", "fusion/probe.py:26, runtime/runtime.py:90")
def _():
    opt = torch.optim.SGD(params(), lr=0.1)
    names = ["_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
             "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
             "_optimizer_load_state_dict_post_hooks"]
    missing = [n for n in names if not hasattr(opt, n)]
    return not missing, "missing: " + ", ".join(missing) if missing else "all present"


@check("every torch.optim optimizer steps from empty state (the probe's copy is made without __init__)",
       "fusion/probe.py:41-60 (_clone)")
def _():
    failing, eager = [], []
    for name in dir(torch.optim):
        cls = getattr(torch.optim, name)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) \
                or cls in (torch.optim.Optimizer, torch.optim.SparseAdam):    # SparseAdam takes sparse grads only
            continue
        ps = params()
        try:
            opt = cls(ps, lr=0.01)
        except Exception:
            continue
        if len(opt.state):
            eager.append(name)
        opt.state = collections.defaultdict(dict)     # what the probe's copy starts from
        for p in ps:
            p.grad = torch.ones_like(p)
        try:
            opt.step(lambda: torch.tensor(0.0)) if name == "LBFGS" else opt.step()
        except Exception as e:
            failing.append(f"{name} ({type(e).__name__}: {e})")
    detail = "fail from empty state: " + "; ".join(failing) if failing else "all step"
    return not failing, detail + (f"; state made in __init__ by {', '.join(eager)}" if eager else "")


@check("AdamW is an Adam subclass (qadam continues both with Adam's own step)",
       "comm/algorithms/qadam.py:50 (unsupported), 154-155 (_decoupled), 210-215 (_adam_step)")
def _():
    sub = issubclass(torch.optim.AdamW, torch.optim.Adam)
    decoupled = "decoupled_weight_decay" in torch.optim.Adam(params()).defaults
    return sub, (f"issubclass={sub}; Adam takes decoupled_weight_decay={decoupled}"
                 + ("" if sub else ": qadam refuses AdamW ('continues torch.optim.Adam and AdamW only')"))


@check("Adam's state after a step: 0-dim float32 CPU 'step', exp_avg, exp_avg_sq", "comm/algorithms/qadam.py:137-164")
def _():
    ps = params()
    opt = torch.optim.Adam(ps, amsgrad=True)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    state = opt.state[ps[0]]
    step = state.get("step")
    ok = (isinstance(step, torch.Tensor) and step.dim() == 0 and step.dtype == torch.float32
          and {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"} <= set(state))
    kind = f"{step.dtype} {tuple(step.shape)}" if isinstance(step, torch.Tensor) else type(step).__name__
    return ok, f"keys {sorted(state)}, step {kind}"


@check("Optimizer._init_group marked by dynamo (_torchdynamo_disable)", "fusion/rounding.py:163-165")
def _():
    init_group = torch.optim.Adam._init_group
    flag = getattr(init_group, "_torchdynamo_disable", False)
    unwrapped = inspect.unwrap(init_group)
    return True, f"_torchdynamo_disable={flag!r}; unwrap gives {'another function' if unwrapped is not init_group else 'itself'}"


@check("torch.utils._foreach_utils._get_fused_kernels_supported_devices", "fusion/rounding.py:24, 110")
def _():
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    devices = _get_fused_kernels_supported_devices()
    return True, f"{devices}" + ("" if "cpu" in devices else " (no cpu: the fused-kernel route is refused on CPU)")


@check("torch._foreach_copy_", "fusion/chunk_grads.py:73, 89, 122")
def _():
    a, b = [torch.zeros(2)], [torch.ones(2)]
    torch._foreach_copy_(a, b)
    return bool(a[0].eq(1).all()), "copies"


@check("Tensor._version and ._base", "fusion/forward.py:62, 89; fusion/chunk_grads.py:113")
def _():
    buf = torch.zeros(4)
    v = buf[:2]
    before = buf._version
    v.add_(1)
    return v._base is buf and buf._version > before, "view._base is its buffer; in-place bumps _version"


# -- autograd and module hooks ---------------------------------------------------------------------

@check("Tensor.register_post_accumulate_grad_hook",
       "modes/watch.py:72, fusion/backward.py:91, comm/allreduce.py:84, comm/algorithms/base.py:124")
def _():
    p = torch.nn.Parameter(torch.ones(2))
    seen = []
    p.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad is not None))
    p.sum().backward()
    return seen == [True], f"hook saw grads: {seen}"


@check("Variable._execution_engine.queue_callback from a grad hook runs at backward's end",
       "modes/watch.py:93, comm/allreduce.py:141, comm/algorithms/base.py:133")
def _():
    p = torch.nn.Parameter(torch.ones(2))
    order = []

    def hook(t):
        order.append("hook")
        torch.autograd.Variable._execution_engine.queue_callback(lambda: order.append("callback"))
    p.register_post_accumulate_grad_hook(hook)
    (p * 2).sum().backward()
    order.append("returned")
    return order == ["hook", "callback", "returned"], " -> ".join(order)


@check("torch.nn.modules.module.register_module_forward_pre_hook / _forward_hook (global)",
       "modes/watch.py:73, modes/forward_reads.py:51, reporting/step_timer.py:106")
def _():
    seen = []
    m = torch.nn.modules.module
    h1 = m.register_module_forward_pre_hook(lambda mod, args: seen.append("pre"))
    h2 = m.register_module_forward_hook(lambda mod, args, out: seen.append("post"))
    try:
        torch.nn.Linear(2, 2)(torch.ones(1, 2))
    finally:
        h1.remove()
        h2.remove()
    return seen == ["pre", "post"], " -> ".join(seen)


@check("torch.compiler.is_compiling", "modes/watch.py:101, modes/forward_reads.py:127")
def _():
    from torch.compiler import is_compiling
    return is_compiling() is False, "present, False outside compile"


@check("torch.overrides.TorchFunctionMode entered by hand sees ops", "modes/watch.py:40-50, 120-137")
def _():
    from torch.overrides import TorchFunctionMode
    names = []

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            names.append(getattr(func, "__name__", None))
            return func(*args, **(kwargs or {}))
    mode = Mode()
    mode.__enter__()
    try:
        torch.ones(2).add(1)
    finally:
        mode.__exit__(None, None, None)
    return "add" in names, f"saw {names}"


@check("dynamo traces a global forward pre-hook that records into a dict and a set",
       "modes/watch.py:73, 99-103 (Observation._on_module; torch's part only: the crash on 2.10-2.11 "
       "also needs the watch's TorchFunctionMode, see test_a_compiled_model_rules_out_forward)")
def _():
    findings, entered = {}, set()

    def hook(module, args):     # what Observation._on_module does
        if torch.compiler.is_compiling():
            findings["compiled"] = findings.get("compiled", 0) + 1
        entered.update(id(p) for p in module._parameters.values() if p is not None)
    h = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        model = torch.compile(torch.nn.Linear(2, 2), backend="eager")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")    # "global hooks fire an extra time": known, harmless here
            model(torch.ones(1, 2))
            model(torch.ones(1, 2))
    except Exception as e:
        return False, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
    finally:
        h.remove()
    return True, f"runs; hook recorded {findings}"


@check("Module.__getattr__ defined on Module itself; Module._apply", "modes/forward_reads.py:73, 80")
def _():
    ok = "__getattr__" in vars(torch.nn.Module) and "_apply" in vars(torch.nn.Module)
    return ok, "both in vars(Module)" if ok else "missing from vars(Module)"


# -- dynamo ----------------------------------------------------------------------------------------

@check("torch._dynamo.config.recompile_limit", "fusion/rounding.py:247")
def _():
    import torch._dynamo.config as cfg
    if hasattr(cfg, "recompile_limit"):
        return True, f"recompile_limit={cfg.recompile_limit}"
    return False, f"missing; cache_size_limit={getattr(cfg, 'cache_size_limit', 'missing too')}"


@check("torch._dynamo.config.patch(force_parameter_static_shapes, fail_on_recompile_limit_hit)",
       "fusion/rounding.py:205")
def _():
    import torch._dynamo.config as cfg
    missing = [k for k in ("force_parameter_static_shapes", "fail_on_recompile_limit_hit") if not hasattr(cfg, k)]
    if missing:
        old = [k for k in ("fail_on_cache_limit_hit",) if hasattr(cfg, k)]
        return False, f"missing: {', '.join(missing)}" + (f" (has {', '.join(old)})" if old else "")
    with cfg.patch(force_parameter_static_shapes=False, fail_on_recompile_limit_hit=True):
        pass
    return True, "both keys patch"


@check("torch._dynamo.exc.FailOnRecompileLimitHit", "fusion/rounding.py:246 (compile_failure)")
def _():
    import torch._dynamo.exc as exc
    if hasattr(exc, "FailOnRecompileLimitHit"):
        return True, "present"
    old = [n for n in dir(exc) if "Limit" in n]
    return False, f"missing (has {', '.join(old) or 'nothing alike'})"


@check("torch._dynamo.utils.counters['stats']['unique_graphs'] counts compiled graphs", "fusion/rounding.py:23, 218-225")
def _():
    from torch._dynamo.utils import counters
    before = counters["stats"]["unique_graphs"]
    torch.compile(lambda x: x * 3 + 1, backend="eager")(torch.ones(3))
    after = counters["stats"]["unique_graphs"]
    return after > before, f"{before} -> {after}"


# -- torch.distributed -----------------------------------------------------------------------------

def _gloo_world_of_one():
    """A one-process gloo group (file store in a temporary folder): enough for DDP and DTensor."""
    import torch.distributed as dist
    if not dist.is_initialized():
        path = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    return dist


@check("torch.distributed.distributed_c10d._get_default_store", "job_store.py:44")
def _():
    dist = _gloo_world_of_one()
    store = dist.distributed_c10d._get_default_store()
    return store is not None, type(store).__name__


@check("ProcessGroup._get_backend(device).options._timeout", "comm/algorithms/base.py:45 (falls back to default_pg_timeout)")
def _():
    dist = _gloo_world_of_one()
    timeout = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    return True, f"{timeout}"


@check("dist.all_gather_single or dist.all_gather_into_tensor", "comm/collectives.py:19")
def _():
    import torch.distributed as dist
    has = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    return bool(has), f"has {', '.join(has)}"


@check("public dist helpers (get_global_rank, get_process_group_ranks, GroupMember.WORLD, default_pg_timeout, "
       "batch_isend_irecv, all_to_all_single, new_group(use_local_synchronization))",
       "comm/algorithms/stages.py:37, async_average.py:230-232, shutdown.py:57, base.py:47")
def _():
    import torch.distributed as dist
    names = ["get_global_rank", "get_process_group_ranks", "GroupMember", "default_pg_timeout",
             "batch_isend_irecv", "all_to_all_single", "new_group"]
    missing = [n for n in names if not hasattr(dist, n)]
    if "new_group" not in missing and "use_local_synchronization" not in inspect.signature(dist.new_group).parameters:
        missing.append("new_group(use_local_synchronization=)")
    return not missing, "missing: " + ", ".join(missing) if missing else "all present"


@check("destroy_process_group defined in both torch.distributed and distributed_c10d", "comm/algorithms/shutdown.py:33-35")
def _():
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    where = [m.__name__ for m in (dist, c10d) if "destroy_process_group" in vars(m)]
    return bool(where), f"in {', '.join(where)}"


@check("DDP private attributes and methods autopatch reads or wraps", "comm/takeover.py:43-75, 118-138")
def _():
    dist = _gloo_world_of_one()
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(torch.nn.Linear(2, 2))
    problems = []
    for name in ("register_comm_hook", "_register_builtin_comm_hook", "_register_fused_optim",
                 "_set_static_graph", "join_hook", "forward", "_build_params_for_reducer"):
        if not callable(getattr(DDP, name, None)):
            problems.append(f"method {name}")
    for name in ("_join_config", "static_graph", "mixed_precision", "find_unused_parameters", "process_group",
                 "require_backward_grad_sync", "require_forward_param_sync"):
        if not hasattr(ddp, name):
            problems.append(f"attribute {name}")
    optional = [n for n in ("_comm_hooks", "_delay_all_reduce_params", "_use_python_reducer") if not hasattr(ddp, n)]
    if hasattr(ddp, "_join_config") and not hasattr(ddp._join_config, "enable"):
        problems.append("_join_config.enable")
    if callable(getattr(ddp, "_build_params_for_reducer", None)):
        built = ddp._build_params_for_reducer()
        if not (isinstance(built, tuple) and len(built) == 2):
            problems.append(f"_build_params_for_reducer returns {type(built).__name__}, not (params, sparse)")
    detail = ("missing: " + ", ".join(problems)) if problems else "all present"
    if optional:
        detail += f"; read with getattr defaults, absent: {', '.join(optional)}"
    return not problems, detail


@check("parameters get _in_backward_optimizers from apply_optimizer_in_backward", "comm/takeover.py:72")
def _():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # 2.4: "TorchScript support for functional optimizers is deprecated"
        import torch.distributed.optim as dopt
    fn = getattr(dopt, "_apply_optimizer_in_backward", None)
    if fn is None:
        return False, "torch.distributed.optim._apply_optimizer_in_backward is missing"
    p = torch.nn.Parameter(torch.ones(2))
    fn(torch.optim.SGD, [p], {"lr": 0.1})
    return hasattr(p, "_in_backward_optimizers"), "attribute set" if hasattr(p, "_in_backward_optimizers") else "not set"


@check("FSDP1 marks its parameters _is_flat_param / _fsdp_flattened", "fusion/eligibility.py:35-38, reporting/collectives.py:13")
def _():
    import torch.distributed.fsdp as fsdp
    folder = os.path.dirname(fsdp.__file__)
    text = ""
    for name in os.listdir(folder):
        if name.endswith(".py"):
            with open(os.path.join(folder, name)) as f:
                text += f.read()
    missing = [n for n in ("_is_flat_param", "_fsdp_flattened") if n not in text]
    return not missing, "missing from torch/distributed/fsdp: " + ", ".join(missing) if missing else "both in FSDP's source"


@check("torch.distributed.tensor.DTensor (public module)", "fusion/eligibility.py:64 (is_dtensor), fusion/local_shards.py:249")
def _():
    import importlib
    try:
        mod = importlib.import_module("torch.distributed.tensor")
    except ImportError as e:
        mod, why = None, f"{type(e).__name__}: {e}"
    if mod is not None and hasattr(mod, "DTensor"):
        return True, "present"
    detail = "torch.distributed.tensor has no DTensor" if mod is not None else why
    try:
        from torch.distributed._tensor import DTensor  # noqa: F401
        detail += "; torch.distributed._tensor.DTensor exists"
    except ImportError:
        pass
    return False, detail


@check("DTensor._local_tensor and DTensor.from_local(shape=, stride=, run_check=)", "fusion/local_shards.py:49, 248-251")
def _():
    _gloo_world_of_one()
    try:
        from torch.distributed.tensor import DTensor, Replicate, init_device_mesh
    except ImportError:
        from torch.distributed._tensor import DTensor, Replicate, init_device_mesh
    mesh = init_device_mesh("cpu", (1,))
    d = DTensor.from_local(torch.ones(4), mesh, [Replicate()], run_check=False, shape=torch.Size([4]), stride=(1,))
    has_local = isinstance(getattr(d, "_local_tensor", None), torch.Tensor)
    return has_local, "from_local takes shape/stride; _local_tensor " + ("present" if has_local else "missing")


@check("Tensor.untyped_storage and set_(untyped storage, offset, size)", "data/store/sample_codec.py:96, fusion/flat.py:118")
def _():
    t = torch.arange(4, dtype=torch.float32)
    w = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), 0, (16,))
    return w.numel() == 16, "a byte window over a float tensor's storage"


def main():
    results = []
    for name, where, fn in CHECKS:
        try:
            ok, detail = fn()
        except Exception as e:
            ok, detail = False, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            if os.environ.get("PROBE_TRACEBACK"):
                traceback.print_exc()
        results.append({"name": name, "where": where, "ok": bool(ok), "detail": detail})
        print(f"{'ok  ' if ok else 'DIFF'}  {name}: {detail}", flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    print(f"torch {torch.__version__}: {sum(r['ok'] for r in results)} of {len(results)} as autopatch expects")


if __name__ == "__main__":
    main()
