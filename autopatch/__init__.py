"""autopatch: faster PyTorch training without editing the script.

The whole public face: ``enable``, ``disable``, ``is_enabled``, ``report``, ``flush``.
"""

import atexit
import sys
import threading
import warnings

from . import env

__all__ = ["enable", "disable", "is_enabled", "report", "flush", "PolicyError", "__version__"]
__version__ = "0.1.0"

_lock = threading.RLock()
_runtime = None        # the active Runtime, or None
_last = None           # the most recent Runtime, kept for report() after disable()
_exit = {"registered": False, "summary": False}


def enable(policy=None, **overrides):
    """Enable autopatch for this process.

    ``policy``: a builtin policy name (``default``, ``safe``, ``multi_layer``, ...) or a YAML path;
    ``None`` uses ``FUSEDOPT_POLICY`` or ``default``. Keyword overrides (``mode=``,
    ``chunk_bytes=``, ``exact=``, ``report=``, ``logdir=``, ``autotune=``, or a section mapping
    such as ``fusion={...}``) win over environment variables, which win over the policy file.
    Raises ``PolicyError`` for an invalid policy. Calling it again while enabled only warns.
    """
    global _runtime, _last
    import os
    from . import policy as _policy
    from .runtime import Runtime
    with _lock:
        if _runtime is not None:
            warnings.warn(f"autopatch is already enabled (policy {_runtime.policy.source}); "
                          "call autopatch.disable() first to change it", RuntimeWarning, stacklevel=2)
            return
        pol = _policy.load(policy or os.environ.get(env.POLICY) or None,
                           env_overrides=env.policy_overrides(),
                           overrides=_policy.enable_overrides(overrides))
        rt = Runtime(pol)
        rt.install()
        _runtime = _last = rt
        if not _exit["registered"]:
            atexit.register(_at_exit)
            _exit["registered"] = True


def disable():
    """Undo every patch and hook; optimizers go on exactly as unpatched ones. Idempotent."""
    global _runtime
    with _lock:
        if _runtime is None:
            return
        _runtime.uninstall()
        _runtime = None


# Subpackages reachable as attributes (``autopatch.contrib.fuse_optimizer(...)``), imported on
# first use: contrib imports torch, and ``import autopatch`` must not.
_LAZY_SUBMODULES = ("contrib", "integrations")


def __getattr__(name):
    # Imported on first use: the start-up gate imports this package and must be able to catch a
    # broken PyYAML like any other start-up failure.
    if name == "PolicyError":
        from .policy import PolicyError
        return PolicyError
    if name in _LAZY_SUBMODULES:
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'autopatch' has no attribute {name!r}")


def is_enabled():
    return _runtime is not None


def flush():
    """Apply every deferred update now, so weights can be read (mode forward defers updates to
    the next forward; the next step() and torch's ways of reading weights, such as parameters(),
    module attributes, state_dict() and torch.save, apply them by themselves)."""
    with _lock:
        if _runtime is not None:
            _runtime.flush()


def report():
    """A JSON-serialisable dict: per optimizer, the mode that ran and why, plus timings."""
    from .telemetry import build_report
    with _lock:
        return build_report(_last, enabled=_runtime is not None)


def _at_exit():
    from .telemetry import summary, write_report
    rt = _last
    if rt is None or not rt.controllers:
        return   # a launcher (torchrun) or a helper process: no optimizer, nothing to report
    rep = report()
    if rt.policy.logging.report:
        try:
            path = write_report(rep, rt.policy.logging.report)
        except OSError as e:
            print(f"autopatch: could not write report: {e}", file=sys.stderr)
        else:
            if path and _exit["summary"]:
                print(f"autopatch: report written to {path}", file=sys.stderr)
    if _exit["summary"] and rt.policy.logging.summary:
        print(summary(rep), file=sys.stderr)
