"""Zero-code start-up: what the installed ``autopatch.pth`` line calls when FUSEDOPT_ENABLE is set
to anything but ``0`` or ``false``.

It never breaks the user's program: a problem (a FUSEDOPT_ENABLE value other than 1/true/0/false
included) becomes a warning on stderr and the run goes on unpatched, except an invalid policy
(exit code 2 before any user code runs) and ``FUSEDOPT_STRICT=1``, which makes every problem fatal.
"""

import os
import sys

_done = False


def run():
    global _done
    if _done:
        return
    _done = True
    from . import env
    strict = env.flag(env.STRICT)
    enabled = env.enable_value()
    if enabled is None:
        _problem(f"{env.ENABLE}={os.environ[env.ENABLE]!r} is not understood (use 1, true, yes or "
                 "on to enable, 0, false, no or off not to); autopatch stays off", strict)
        return
    if not enabled:
        return
    try:
        import autopatch
        from .policy import PolicyError
    except Exception as e:  # a broken install must not break the program
        _failed(e, strict)
        return
    try:
        autopatch.enable()
        autopatch.announce_at_exit()
    except PolicyError as e:
        sys.stderr.write(f"autopatch: invalid policy: {e}\n")
        sys.stderr.flush()
        os._exit(2)
    except Exception as e:
        _failed(e, strict)


def _failed(error, strict):
    _problem(f"not enabled, start-up failed: {type(error).__name__}: {error}", strict)


def _problem(message, strict):
    sys.stderr.write(f"autopatch: {message}\n")
    if strict:
        sys.stderr.write("autopatch: FUSEDOPT_STRICT=1, stopping\n")
        sys.stderr.flush()
        os._exit(1)
