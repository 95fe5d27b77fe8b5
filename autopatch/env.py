"""Every FUSEDOPT_* environment variable, parsed in one place.

Kept free of heavy imports: the start-up gate reads it before the user's program runs.
"""

import os

ENABLE = "FUSEDOPT_ENABLE"        # 1/true: enable at start-up; 0/false/unset: do not; else warn, stay off
STRICT = "FUSEDOPT_STRICT"        # 1: start-up problems and autopatch's failures in a step raise instead of a warning
POLICY = "FUSEDOPT_POLICY"        # builtin policy name or path to a YAML file
MODE = "FUSEDOPT_MODE"            # overrides fusion.mode
CHUNK_BYTES = "FUSEDOPT_CHUNK_BYTES"  # overrides fusion.chunk_bytes
EXACT = "FUSEDOPT_EXACT"          # overrides fusion.exact: bitwise or rounding
SHARD = "FUSEDOPT_SHARD"          # overrides fusion.shard: 1 shards the optimizer state across DDP ranks
LOGDIR = "FUSEDOPT_LOGDIR"        # overrides logging.tensorboard_dir
REPORT = "FUSEDOPT_REPORT"        # overrides logging.report: JSON report path, "{rank}" expanded
BREAKDOWN = "FUSEDOPT_BREAKDOWN"  # overrides logging.breakdown: 0 turns the per-step breakdown off
AUTOTUNE = "FUSEDOPT_AUTOTUNE"    # overrides autotune.enabled
AUTOTUNE_RESUME = "FUSEDOPT_AUTOTUNE_RESUME"  # overrides autotune.resume
# The forms of Bagua's autotune flags that `autopatch run` passes on to every process it starts:
AUTOTUNE_MAX_SAMPLES = "FUSEDOPT_AUTOTUNE_MAX_SAMPLES"      # overrides autotune.max_samples
AUTOTUNE_TRIAL_SECONDS = "FUSEDOPT_AUTOTUNE_TRIAL_SECONDS"  # overrides autotune.trial_seconds
AUTOTUNE_WARMUP_SECONDS = "FUSEDOPT_AUTOTUNE_WARMUP_SECONDS"  # overrides autotune.warmup_seconds
AUTOTUNE_LOG = "FUSEDOPT_AUTOTUNE_LOG"                      # overrides autotune.log_csv
ALGORITHM = "FUSEDOPT_ALGORITHM"        # overrides algorithm.name: decentralized, qadam, async, ...
DATA_CACHE = "FUSEDOPT_DATA_CACHE"      # overrides data.cache: 1, local, redis or redis://host:port
DATA_BALANCE = "FUSEDOPT_DATA_BALANCE"  # overrides data.load_balance: len or module:function

# The one set of words autopatch reads as booleans, in variables and in policies alike (any case,
# surrounding spaces ignored). Anything else is not understood: a typo such as "2" or "ture" must
# never silently decide whether a run is patched.
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

# The single policy key each variable overrides. Values stay raw strings: the policy checks them
# with its own rules, so a bad one is a PolicyError naming the variable, like a bad policy file.
OVERRIDES = {
    MODE: "fusion.mode",
    CHUNK_BYTES: "fusion.chunk_bytes",
    EXACT: "fusion.exact",
    SHARD: "fusion.shard",
    LOGDIR: "logging.tensorboard_dir",
    REPORT: "logging.report",
    BREAKDOWN: "logging.breakdown",
    AUTOTUNE: "autotune.enabled",
    AUTOTUNE_RESUME: "autotune.resume",
    AUTOTUNE_MAX_SAMPLES: "autotune.max_samples",
    AUTOTUNE_TRIAL_SECONDS: "autotune.trial_seconds",
    AUTOTUNE_WARMUP_SECONDS: "autotune.warmup_seconds",
    AUTOTUNE_LOG: "autotune.log_csv",
    ALGORITHM: "algorithm.name",
    DATA_CACHE: "data.cache",
    DATA_BALANCE: "data.load_balance",
}
_STRIPPED = {MODE, CHUNK_BYTES, EXACT, SHARD, BREAKDOWN, AUTOTUNE, AUTOTUNE_MAX_SAMPLES, AUTOTUNE_TRIAL_SECONDS, AUTOTUNE_WARMUP_SECONDS,
             ALGORITHM, DATA_CACHE, DATA_BALANCE}


def boolean(text):
    """``text`` as True or False, or None when it is not one of the boolean words."""
    word = str(text).strip().lower()
    return True if word in TRUE_WORDS else False if word in FALSE_WORDS else None


def flag(name, environ=None):
    """True when the variable holds a true word; unset or anything else counts as false."""
    return boolean((environ if environ is not None else os.environ).get(name, "")) is True


def enable_value(environ=None):
    """FUSEDOPT_ENABLE as True or False (unset or empty: False), or None when not understood.
    autopatch.pth calls the start-up gate for every value but unset, "0" and "false", so the gate
    can warn about the rest."""
    raw = (environ if environ is not None else os.environ).get(ENABLE, "")
    return False if not raw.strip() else boolean(raw)


def policy_overrides(environ=None):
    """The policy keys set by environment variables, as dotted key -> raw value."""
    env = environ if environ is not None else os.environ
    return {key: env[var].strip() if var in _STRIPPED else env[var]
            for var, key in OVERRIDES.items() if env.get(var)}
