"""Zero-code start-up: what the installed ``autopatch.pth`` line calls when FUSEDOPT_ENABLE is true.

It never breaks the user's program: a problem becomes a warning on stderr and the run goes on
unpatched, except an invalid policy (exit code 2 before any user code runs) and
``FUSEDOPT_STRICT=1``, which makes every problem fatal.
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
    try:
        import autopatch
        from .policy import PolicyError
    except Exception as e:  # a broken install must not break the program
        _failed(e, strict)
        return
    try:
        autopatch.enable()
        autopatch._exit["summary"] = True
    except PolicyError as e:
        sys.stderr.write(f"autopatch: invalid policy: {e}\n")
        sys.stderr.flush()
        os._exit(2)
    except Exception as e:
        _failed(e, strict)


def _failed(error, strict):
    sys.stderr.write(f"autopatch: not enabled, start-up failed: {type(error).__name__}: {error}\n")
    if strict:
        sys.stderr.write("autopatch: FUSEDOPT_STRICT=1, stopping\n")
        sys.stderr.flush()
        os._exit(1)
