"""YAML policy -> validated, frozen dataclasses.

Every setting is declared once (``settings.py``): its default, its check (``checks.py``), what it
means. A policy file is read by a hardened YAML loader (``yaml_reader.py``) and then checked key
by key (``loading.py``); every error names the file, the line and the dotted key, and echoes at
most ``SHOWN`` characters of a value (``messages.py``). Environment variables and ``enable()``
arguments pass the same checks. Precedence, lowest first: builtin defaults < policy file <
environment < ``enable()`` arguments.
"""

from .checks import REDIS_SCHEMES, MAX_CACHE_NAME, STANDARD_MODULES, cache_backend, class_matches, complexity_spec
from .loading import ENABLE_ALIASES, MAX_NAME, builtin_dir, builtin_names, enable_overrides, load, resolve_path
from .messages import SHOWN, PolicyError, shown
from .settings import (KEYS, SCHEMA_VERSION, SECTIONS, Algorithm, Allreduce, Autotune, Data, Fusion, Key, Logging,
                       Optimizers, Policy, algorithm_settings, check_algorithm_name, check_algorithm_setting,
                       check_setting, knob_value, setting)
from .yaml_reader import MAX_DEPTH, MAX_FILE_BYTES, MAX_REPEATED

__all__ = [
    "ENABLE_ALIASES", "KEYS", "MAX_CACHE_NAME", "MAX_DEPTH", "MAX_FILE_BYTES", "MAX_NAME", "MAX_REPEATED",
    "REDIS_SCHEMES", "SCHEMA_VERSION", "SECTIONS", "SHOWN", "STANDARD_MODULES", "Algorithm", "Allreduce",
    "Autotune", "Data", "Fusion", "Key", "Logging", "Optimizers", "Policy", "PolicyError", "algorithm_settings",
    "builtin_dir", "builtin_names", "cache_backend", "check_algorithm_name", "check_algorithm_setting",
    "check_setting", "class_matches", "complexity_spec", "enable_overrides", "knob_value", "load", "resolve_path",
    "setting", "shown",
]
