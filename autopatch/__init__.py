"""autopatch: faster PyTorch training without editing the script.

The whole public face: ``enable`` (returns the ``Session``), ``session``, ``disable``,
``is_enabled``, ``report``, ``flush``.
"""

import atexit
import sys
import threading
import warnings

from . import env

__all__ = ["enable", "disable", "session", "is_enabled", "report", "flush", "announce_at_exit", "PolicyError",
           "__version__"]
__version__ = "0.1.0"

_lock = threading.RLock()
_wanted = None         # the Session asked for by the last enable(), or None after disable()
_installed = None      # the Session whose patches are in place
_last = None           # the most recent Session, kept for report() after disable()
_exit = {"registered": False, "summary": False}


def enable(policy=None, **overrides):
    """Enable autopatch for this process and return its ``Session`` (runtime/session.py).

    ``policy``: a builtin policy name (``default``, ``safe``, ``multi_layer``, ...) or a YAML path;
    ``None`` uses ``FUSEDOPT_POLICY`` or ``default``. Keyword overrides (``mode=``,
    ``chunk_bytes=``, ``exact=``, ``report=``, ``logdir=``, ``autotune=``, or a section mapping
    such as ``fusion={...}``) win over environment variables, which win over the policy file.
    Raises ``PolicyError`` for an invalid policy. Calling it again while enabled only warns, and
    returns the session already open. Safe at any moment, as ``disable()`` is: a step in flight
    ends as it began, and the patches are in place from the next one on.
    """
    global _wanted, _last
    import os
    from . import policy as _policy
    from .runtime import Session
    with _lock:
        if _wanted is not None:
            warnings.warn(f"autopatch is already enabled (policy {_wanted.policy.source}); "
                          "call autopatch.disable() first to change it", RuntimeWarning, stacklevel=2)
            return _wanted
        pol = _policy.load(policy or os.environ.get(env.POLICY) or None,
                           env_overrides=env.policy_overrides(),
                           overrides=_policy.enable_overrides(overrides))
        opened = _wanted = _last = Session(pol)
        if not _exit["registered"]:
            atexit.register(_at_exit)
            _exit["registered"] = True
    _put_in_place()
    return opened


def disable():
    """Undo every patch and hook; optimizers go on exactly as unpatched ones. Idempotent.

    Safe at any moment. A step in flight on another thread ends as it began, and disable()
    returns once it has, with every original in place (past ``steps_in_flight.WAIT_SECONDS`` it
    warns and returns, and the originals go back as that step ends). Called from a signal handler
    that interrupted a step on its own thread, it returns at once, and the originals go back as
    that step ends, before ``step()`` returns to the interrupted code. What a mode holds back is
    applied as its patches go, so the weights are those of the unpatched run.
    """
    global _wanted
    with _lock:
        _wanted = None
    _put_in_place()


def _put_in_place():
    """Make the installed session the one wanted, at a moment no step is in flight."""
    from .steps_in_flight import IN_FLIGHT
    IN_FLIGHT.toggle(_settled, _reconcile)


def _settled():
    from .patches.ledger import LEDGER
    return _installed is _wanted and (_wanted is not None or not LEDGER.installed())


def _reconcile():
    """One move towards the session wanted: the one installed goes (with every patch left in
    the ledger: model.with_bagua, and whatever a room left), or the one wanted comes."""
    global _installed, _wanted
    from .patches.ledger import LEDGER, standing
    wanted = _wanted
    if _installed is not None and _installed is not wanted:
        leaving, _installed = _installed, None
        leaving.runtime.uninstall()
        LEDGER.uninstall()
    elif wanted is None:
        LEDGER.uninstall()
    else:
        try:
            wanted.install()
            standing.install()
        except BaseException:
            with _lock:
                if _wanted is wanted:
                    _wanted = None
            raise
        _installed = wanted


def session():
    """The active ``Session`` (what ``enable()`` returned), or None when autopatch is off."""
    return _wanted


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


def announce_at_exit():
    """At exit, print the summary (and where the report went) on stderr, as zero-code runs do."""
    _exit["summary"] = True


def is_enabled():
    return _wanted is not None


def flush():
    """Apply every deferred update now, so weights can be read (mode forward defers updates to
    the next forward; the next step() and torch's ways of reading weights, such as parameters(),
    module attributes, state_dict() and torch.save, apply them by themselves)."""
    installed = _installed
    if installed is not None:
        installed.flush()


def report():
    """A JSON-serialisable dict: per optimizer, the mode that ran and why, plus timings."""
    from .reporting.json_report import build_report
    with _lock:
        return build_report(_last, enabled=_wanted is not None)


def _at_exit():
    from .reporting.json_report import write_report
    from .reporting.summary import summary
    last = _last
    if last is None or not (last.optimizers or last.served_data):
        return   # a launcher (torchrun) or a helper process: no optimizer, no data, nothing to report
    rep = report()
    if last.policy.logging.report:
        try:
            path = write_report(rep, last.policy.logging.report)
        except Exception as e:     # at exit too, a report that cannot be written is only said
            print(f"autopatch: the report was not written to {last.policy.logging.report}: "
                  f"{type(e).__name__}: {e}", file=sys.stderr)
        else:
            if path and _exit["summary"]:
                print(f"autopatch: report written to {path}", file=sys.stderr)
    if _exit["summary"] and last.policy.logging.summary:
        print(summary(rep), file=sys.stderr)
