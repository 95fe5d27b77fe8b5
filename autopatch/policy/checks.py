"""The checks of policy values: each takes a raw value (YAML, a variable's string, an
``enable()`` argument) and returns it checked, or raises a TypeError or ValueError saying why,
with at most ``SHOWN`` characters of the value."""

import fnmatch
import math
import re
import sys
import urllib.parse

from .. import env as _env
from ..tunables import KNOBS
from ..vocabulary import OFF, POLICY_MODES, SWITCHABLE_MODES
from .messages import shown


def class_matches(qualname, globs):
    """Class-name globs (include/exclude, force/forbid) match the qualified or the bare name."""
    short = qualname.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(qualname, g) or fnmatch.fnmatchcase(short, g) for g in globs)


_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*$")
_UNITS = {None: 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def byte_count(v):
    if isinstance(v, bool):
        raise TypeError("expected a byte count like 1048576 or '1MiB'")
    if isinstance(v, int):
        n = v
    elif isinstance(v, str) and _SIZE.match(v):
        num, unit = _SIZE.match(v).groups()
        n = int(num) * _UNITS[unit]
    else:
        raise TypeError("expected a byte count like 1048576 or '1MiB'")
    if n < 1024:
        raise ValueError(f"must be at least 1024 bytes, got {n}")
    return n


def one_of(options):
    def check(v):
        if v not in options:
            raise ValueError(f"expected one of {', '.join(map(str, options))}; got {shown(v)}")
        return v
    return check


def typed(kind, lo=None, hi=None):
    def check(v):
        if kind is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if kind is int and isinstance(v, str) and v.strip().lstrip("-").isdecimal():
            v = int(v)
        if kind is float and isinstance(v, str):   # from an environment variable
            try:
                v = float(v)
            except ValueError:
                pass
        if kind is bool and isinstance(v, str) and _env.boolean(v) is not None:
            v = _env.boolean(v)
        if not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
            raise TypeError(f"expected {kind.__name__}, got {type(v).__name__} {shown(v)}")
        if kind is float and not math.isfinite(v):
            raise ValueError(f"must be a finite number, got {v}")
        if lo is not None and v < lo:
            raise ValueError(f"must be >= {lo}, got {shown(v)}")
        if hi is not None and v > hi:
            raise ValueError(f"must be <= {hi}, got {shown(v)}")
        return v
    return check


def optional(check):
    return lambda v: None if v is None or v == "null" else check(v)


def class_globs(v):
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise TypeError("expected a list of class-name globs")
    return tuple(v)


def optional_path(v):
    if v is None or isinstance(v, str):
        return v
    raise TypeError(f"expected a path string or null, got {type(v).__name__}")


def chunk_size(v):
    return "auto" if v == "auto" else byte_count(v)


def policy_mode(v, modes=POLICY_MODES):
    # YAML 1.1 reads an unquoted ``mode: off`` as false.
    return one_of(modes)(OFF if v is False else v)


def auto_or_bool(v):
    return v if v == "auto" else typed(bool)(v)


def mode_candidates(v):
    """``auto`` or a list of modes; ``off`` is always measured, listed or not."""
    if v == "auto":
        return v
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not v:
        raise TypeError("expected auto or a non-empty list of modes")
    return tuple(dict.fromkeys(policy_mode(m, SWITCHABLE_MODES) for m in v))


def knob_names(v):
    v = class_globs(v)
    for k in v:
        one_of(tuple(KNOBS))(k)
    return v


def cache_backend(value):
    """The data cache a setting asks for, or None for none: a true word -> ``local``; ``local``,
    ``redis``, or ``redis://host:port`` URLs (comma-separated) as they are; a false word, empty or
    ``none`` -> None."""
    if value is None or value is False:
        return None
    if value is True:
        return "local"
    text = str(value).strip()
    if not text or text.lower() == "none":
        return None
    word = _env.boolean(text)
    if word is not None:
        return "local" if word else None
    if text in ("local", "redis"):
        return text
    if text.startswith(REDIS_SCHEMES):
        for url in (u.strip() for u in text.split(",") if u.strip()):
            _redis_url(url)
        return text
    raise ValueError(f"data cache {value!r}: use 1, local, redis or redis://host:port")


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
# Bytes of a cache name: every entry's key is "{name}-{signature, 16 hex digits}_{index}", and an
# lmdb key holds at most 511 bytes, so a longer name would fail every read and write of the run.
MAX_CACHE_NAME = 400


def short_cache_name(v):
    v = optional_path(v)
    if v is not None and len(v.encode()) > MAX_CACHE_NAME:
        raise ValueError(f"a cache name is at most {MAX_CACHE_NAME} bytes of UTF-8 (the local store's keys hold "
                         f"511 bytes: the name, the dataset's signature and the index), got {shown(v)}")
    return v


def _redis_url(url):
    """What the Redis client refuses when it connects, refused here (nothing is imported): a server
    that is no redis://, rediss:// or unix:// URL, or a port that is no number from 0 to 65535."""
    if not url.startswith(REDIS_SCHEMES):
        raise ValueError(f"data cache: each server is a redis://host:port URL, not {shown(url)}")
    try:
        urllib.parse.urlsplit(url).port
    except ValueError as e:
        raise ValueError(f"data cache: server {shown(url)}: {e}") from None


# Modules that are no program's own: a cost function named in one is never called (data/sampling/complexity.py).
STANDARD_MODULES = frozenset(getattr(sys, "stdlib_module_names", ())) | frozenset(sys.builtin_module_names) | {
    "builtins", "__future__"}


def complexity_spec(spec):
    """``spec`` when it is ``len``, ``module:function`` or a callable, else ValueError. Nothing is
    imported (a policy is checked before the program runs), but what the run would refuse from the
    name alone is refused here: a module of Python's standard library (``os:system``), never the
    program's own code."""
    if spec is None or spec is False:
        return None
    if callable(spec) or spec == "len":
        return spec
    module, sep, attr = (part.strip() for part in str(spec).partition(":"))
    if not sep or not module or not attr:
        raise ValueError(f"a complexity is 'len' or 'module:function', not {shown(spec)}")
    if module.partition(".")[0] in STANDARD_MODULES:
        raise ValueError(f"{shown(module)} is part of Python's standard library, not the program's own code, "
                         "and a cost function is only called from the program's own; use len, or a function "
                         "of the program's")
    return spec


def all_peers(v):
    if v != "all":
        raise ValueError("async model averaging averages over every rank ('all'), as Bagua's did")
    return v


def qadam_warmup(v):
    if v == 0:
        raise ValueError("qadam needs at least 1 warm-up step (its second moment is frozen after them)")
    return v
