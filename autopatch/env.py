"""Every FUSEDOPT_* environment variable, parsed in one place.

Kept free of heavy imports: the start-up gate reads it before the user's program runs.
"""

import os

ENABLE = "FUSEDOPT_ENABLE"        # 1/true/yes/on: enable autopatch at interpreter start-up
STRICT = "FUSEDOPT_STRICT"        # 1: start-up problems are fatal instead of a warning
POLICY = "FUSEDOPT_POLICY"        # builtin policy name or path to a YAML file
MODE = "FUSEDOPT_MODE"            # overrides fusion.mode
CHUNK_BYTES = "FUSEDOPT_CHUNK_BYTES"  # overrides fusion.chunk_bytes
LOGDIR = "FUSEDOPT_LOGDIR"        # overrides logging.tensorboard_dir
REPORT = "FUSEDOPT_REPORT"        # overrides logging.report: JSON report path, "{rank}" expanded
AUTOTUNE = "FUSEDOPT_AUTOTUNE"    # overrides autotune.enabled
AUTOTUNE_RESUME = "FUSEDOPT_AUTOTUNE_RESUME"  # overrides autotune.resume

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def flag(name, environ=None):
    """True when the variable holds a true-ish value; unknown values count as false."""
    return (environ if environ is not None else os.environ).get(name, "").strip().lower() in _TRUE


def parse_bool(name, value):
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}={value!r}: expected one of 1/0, true/false, yes/no, on/off")


def policy_overrides(environ=None):
    """The policy keys set by environment variables, as dotted key -> raw value."""
    env = environ if environ is not None else os.environ
    out = {}
    if env.get(MODE):
        out["fusion.mode"] = env[MODE].strip()
    if env.get(CHUNK_BYTES):
        out["fusion.chunk_bytes"] = env[CHUNK_BYTES].strip()
    if env.get(LOGDIR):
        out["logging.tensorboard_dir"] = env[LOGDIR]
    if env.get(REPORT):
        out["logging.report"] = env[REPORT]
    if env.get(AUTOTUNE):
        out["autotune.enabled"] = parse_bool(AUTOTUNE, env[AUTOTUNE])
    if env.get(AUTOTUNE_RESUME):
        out["autotune.resume"] = env[AUTOTUNE_RESUME]
    return out
