"""YAML policy -> validated, frozen dataclasses.

A policy is read with ``yaml.safe_load`` semantics only (it can never build Python objects) and
checked key by key; every error names the file, the line and the dotted key.
Precedence, lowest first: builtin defaults < policy file < environment < ``enable()`` arguments.
"""

import dataclasses
import fnmatch
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import env as _env
from .vocabulary import (ALGORITHMS, COMPRESSIONS, EXACTNESS, GRADIENT_ALLREDUCE, OFF,
                         PEER_SELECTION_MODES, POLICY_MODES, SWITCHABLE_MODES)

SCHEMA_VERSION = 1
TUNABLE_KNOBS = ("mode", "chunk_size_2p", "bucket_size_2p", "hierarchical", "compression")
# Search bounds when the policy gives none: (lo, hi) powers of two, or the list of choices.
DEFAULT_BOUNDS = {"mode": SWITCHABLE_MODES, "chunk_size_2p": (14, 26),
                  "bucket_size_2p": (10, 31), "hierarchical": (False, True),
                  "compression": COMPRESSIONS}


def class_matches(qualname, globs):
    """Class-name globs (include/exclude, force/forbid) match the qualified or the bare name."""
    short = qualname.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(qualname, g) or fnmatch.fnmatchcase(short, g) for g in globs)


class PolicyError(ValueError):
    """An invalid policy: the message names the file, the line and the key."""


@dataclass(frozen=True)
class Optimizers:
    include: tuple = ("*",)
    exclude: tuple = ()

    def selects(self, qualname):
        return class_matches(qualname, self.include) and not class_matches(qualname, self.exclude)


@dataclass(frozen=True)
class Fusion:
    mode: str = "auto"
    chunk_bytes: object = "auto"      # "auto" or a byte count
    exact: str = "bitwise"             # "rounding": torch's fused kernels or torch.compile may step
    max_deviation: float = 1e-6        # rounding: largest relative deviation per probe step
    compile_budget_seconds: float = 60.0   # rounding: compile time spent before stepping eagerly
    probe: bool = True
    force: tuple = ()                  # class globs fused without the probe
    forbid: tuple = ()                 # class globs never fused
    observe_steps: int = 3             # steps watched before backward/forward may run
    auto_candidates: object = "auto"   # fused modes auto measures against off; "auto": all
    measure_steps: int = 200           # mode auto: the most steps one measurement takes


@dataclass(frozen=True)
class Allreduce:
    enabled: object = "auto"           # "auto", true or false
    bucket_bytes: int = 25 * 2**20
    compression: str = "none"
    hierarchical: bool = False
    timeout_seconds: object = None     # a collective waited on longer is an error; None: the group's


@dataclass(frozen=True)
class Algorithm:
    """The communication algorithm of DDP models (comm/algorithms/), with Bagua's arguments; a
    key the algorithm does not take is ignored, and None means the algorithm's own default."""
    name: str = GRADIENT_ALLREDUCE
    hierarchical: object = None        # None: hierarchical when the job spans several nodes
    peer_selection_mode: str = "all"   # decentralized: all or shift_one
    communication_interval: int = 1    # decentralized, low_precision_decentralized
    sync_interval_ms: int = 500        # async
    warmup_steps: object = None        # async, qadam: steps of gradient allreduce first


@dataclass(frozen=True)
class Autotune:
    enabled: bool = False
    knobs: tuple = ("mode", "chunk_size_2p", "bucket_size_2p")
    warmup_steps: int = 10
    warmup_seconds: float = 0.0        # warm-up ends when both the steps and the seconds have passed
    trial_seconds: float = 5.0
    windows: int = 5                   # a trial's score is the median over this many windows
    max_samples: int = 20
    batch_size: object = None          # samples per step on each rank; None: detect, else steps/s
    bounds: tuple = ()                 # (knob, choices or (lo, hi)) pairs overriding DEFAULT_BOUNDS
    log_csv: object = None
    resume: object = None
    save_best: object = None

    def bounds_of(self, knob):
        return dict(self.bounds).get(knob, DEFAULT_BOUNDS[knob])


@dataclass(frozen=True)
class Data:
    cache_backend: object = None       # None: no cache; local, redis, or redis://host:port URLs
    cache_name: object = None          # prefix of every cache name
    cache_capacity: object = None      # bytes: the local store's size, or each Redis server's memory
    cache_path: object = None          # the local store's directory
    load_balance: object = None        # None, len, or module:function scoring a sample

    @property
    def wanted(self):
        return self.cache_backend is not None or self.load_balance is not None


@dataclass(frozen=True)
class Logging:
    tensorboard_dir: object = None
    report: object = None
    summary: bool = True


@dataclass(frozen=True)
class Policy:
    name: str = "default"
    source: str = "builtin:default"
    version: int = SCHEMA_VERSION
    optimizers: Optimizers = field(default_factory=Optimizers)
    fusion: Fusion = field(default_factory=Fusion)
    allreduce: Allreduce = field(default_factory=Allreduce)
    algorithm: Algorithm = field(default_factory=Algorithm)
    autotune: Autotune = field(default_factory=Autotune)
    data: Data = field(default_factory=Data)
    logging: Logging = field(default_factory=Logging)

    def to_dict(self):
        return dataclasses.asdict(self)


_SECTIONS = {"optimizers": Optimizers, "fusion": Fusion, "allreduce": Allreduce, "algorithm": Algorithm,
             "autotune": Autotune, "data": Data, "logging": Logging}
# Keys whose value may be a mapping of their own (``data: {cache: {backend: ..., name: ...}}``).
_NESTED = ("data.cache",)
_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*$")
_UNITS = {None: 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def _size(v):
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


def _choice(options):
    def check(v):
        if v not in options:
            raise ValueError(f"expected one of {', '.join(map(str, options))}; got {v!r}")
        return v
    return check


def _typed(kind, lo=None, hi=None):
    def check(v):
        if kind is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if kind is int and isinstance(v, str) and v.strip().lstrip("-").isdigit():
            v = int(v)
        if kind is float and isinstance(v, str):   # from an environment variable
            try:
                v = float(v)
            except ValueError:
                pass
        if kind is bool and isinstance(v, str):
            low = v.strip().lower()
            if low in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                v = low in ("1", "true", "yes", "on")
        if not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
            raise TypeError(f"expected {kind.__name__}, got {type(v).__name__} {v!r}")
        if lo is not None and v < lo:
            raise ValueError(f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise ValueError(f"must be <= {hi}, got {v}")
        return v
    return check


def _globs(v):
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise TypeError("expected a list of class-name globs")
    return tuple(v)


def _optional_path(v):
    if v is None or isinstance(v, str):
        return v
    raise TypeError(f"expected a path string or null, got {type(v).__name__}")


def _chunk(v):
    return "auto" if v == "auto" else _size(v)


def _mode(v, modes=POLICY_MODES):
    # YAML 1.1 reads an unquoted ``mode: off`` as false.
    return _choice(modes)(OFF if v is False else v)


def _auto_bool(v):
    if v == "auto":
        return v
    return _typed(bool)(v)


def _auto_candidates(v):
    """``auto`` or a list of modes; ``off`` is always measured, listed or not."""
    if v == "auto":
        return v
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not v:
        raise TypeError("expected auto or a non-empty list of modes")
    return tuple(dict.fromkeys(_mode(m, SWITCHABLE_MODES) for m in v))


def _knobs(v):
    v = _globs(v)
    for k in v:
        _choice(TUNABLE_KNOBS)(k)
    return v


def _cache_backend(v):
    """A cache backend: true/1/local, redis, or redis://host:port URLs; false/null: no cache."""
    from .data.patches import cache_backend   # torch-free: the same rule as the data room's
    return cache_backend(v)


def _complexity(v):
    from .data.complexity import check_complexity_spec
    if v is None or v is False:
        return None
    check_complexity_spec(v)
    return v


def _optional_bool(v):
    return None if v is None or v == "null" else _typed(bool)(v)


def _optional_int(v):
    return None if v is None else _typed(int, 1)(v)


def _bounds(v):
    """``{knob: [lo, hi]}`` for the ``*_2p`` knobs, ``{knob: [choices...]}`` for the others."""
    if not isinstance(v, dict):
        raise TypeError(f"expected a mapping of knob -> bounds, got {type(v).__name__}")
    out = []
    for knob, b in v.items():
        _choice(TUNABLE_KNOBS)(knob)
        if not isinstance(b, list) or not b:
            raise TypeError(f"{knob}: expected a non-empty list, got {b!r}")
        if knob.endswith("_2p"):
            if len(b) != 2:
                raise ValueError(f"{knob}: expected [lo, hi], got {b!r}")
            lo, hi = (_typed(int, 6, 40)(x) for x in b)
            if lo > hi:
                raise ValueError(f"{knob}: lo {lo} is above hi {hi}")
            out.append((knob, (lo, hi)))
        else:
            check = {"mode": lambda x: _mode(x, SWITCHABLE_MODES),
                     "compression": _choice(COMPRESSIONS)}.get(knob, _typed(bool))
            try:
                choices = tuple(dict.fromkeys(check(x) for x in b))
            except (TypeError, ValueError) as e:
                raise type(e)(f"{knob}: {e}") from None
            out.append((knob, choices))
    return tuple(out)


_CHECKS = {
    "optimizers.include": _globs, "optimizers.exclude": _globs,
    "fusion.mode": _mode, "fusion.chunk_bytes": _chunk,
    "fusion.exact": _choice(EXACTNESS), "fusion.max_deviation": _typed(float, 0.0),
    "fusion.compile_budget_seconds": _typed(float, 0.0),
    "fusion.probe": _typed(bool), "fusion.force": _globs, "fusion.forbid": _globs,
    "fusion.observe_steps": _typed(int, 1, 1000), "fusion.auto_candidates": _auto_candidates,
    "fusion.auto_order": _auto_candidates, "fusion.measure_steps": _typed(int, 16, 1_000_000),
    "allreduce.enabled": _auto_bool, "allreduce.bucket_bytes": _size,
    "allreduce.compression": _choice(COMPRESSIONS), "allreduce.hierarchical": _typed(bool),
    "allreduce.bucket_size_2p": lambda v: 2 ** _typed(int, 10, 31)(v),
    "allreduce.timeout_seconds": lambda v: None if v is None else _typed(float, 0.001)(v),
    "algorithm.name": _choice(ALGORITHMS), "algorithm.hierarchical": _optional_bool,
    "algorithm.peer_selection_mode": _choice(PEER_SELECTION_MODES),
    "algorithm.communication_interval": _typed(int, 1), "algorithm.sync_interval_ms": _typed(int, 0),
    "algorithm.warmup_steps": lambda v: None if v is None else _typed(int, 0)(v),
    "autotune.enabled": _typed(bool), "autotune.knobs": _knobs,
    "autotune.warmup_steps": _typed(int, 0), "autotune.warmup_seconds": _typed(float, 0.0),
    "autotune.trial_seconds": _typed(float, 0.0), "autotune.windows": _typed(int, 1, 100),
    "autotune.max_samples": _typed(int, 1, 1000), "autotune.batch_size": _optional_int,
    "autotune.bounds": _bounds, "autotune.log_csv": _optional_path,
    "autotune.resume": _optional_path, "autotune.save_best": _optional_path,
    "data.cache": _cache_backend, "data.cache.backend": _cache_backend,
    "data.cache.name": _optional_path, "data.cache.capacity": lambda v: None if v is None else _size(v),
    "data.cache.path": _optional_path, "data.load_balance": _complexity,
    "logging.tensorboard_dir": _optional_path, "logging.report": _optional_path,
    "logging.summary": _typed(bool),
}


def builtin_dir():
    """Builtin policies: inside the installed package, or beside it in a source checkout."""
    here = Path(__file__).resolve().parent
    for cand in (here / "policies", here.parent / "policies"):
        if cand.is_dir():
            return cand
    return here / "policies"


def builtin_names():
    return sorted(p.stem for p in builtin_dir().glob("*.yaml"))


def _lines(text):
    """Map dotted key -> 1-based line of that key in the YAML text (best effort)."""
    out = {}
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return out

    def walk(node, prefix):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = f"{prefix}{k.value}"
                out[key] = k.start_mark.line + 1
                walk(v, key + ".")
    walk(root, "")
    return out


# Keys of earlier versions whose meaning another key now carries.
_REPLACED = {"fusion.compile": "fusion.compile was removed: use fusion.exact: rounding (torch's fused "
                               "kernels or torch.compile step the chunks, equal to bitwise within float "
                               "rounding, bounded by fusion.max_deviation)"}

# Another spelling -> the key it sets: Bagua's knob, and auto_order from when auto took a fixed order.
_SPELLINGS = {"allreduce.bucket_size_2p": "allreduce.bucket_bytes",
              "fusion.auto_order": "fusion.auto_candidates", "data.cache": "data.cache.backend"}


def _apply(values, updates, where, lines, origins):
    """Validate dotted-key updates and merge them into the nested ``values`` dict; ``origins``
    records where each key was last set, for errors that only a combination of keys shows."""
    for key, raw in updates.items():
        loc = f"{where}:{lines[key]}" if key in lines else where
        origins[_SPELLINGS.get(key, key)] = loc
        if key in _REPLACED:
            raise PolicyError(f"{loc}: key '{key}': {_REPLACED[key]}")
        if key not in _CHECKS:
            section = key.split(".")[0]
            known = sorted(k for k in _CHECKS if k.startswith(section + ".")) or sorted(_SECTIONS)
            raise PolicyError(f"{loc}: unknown key '{key}' (known: {', '.join(known)})")
        try:
            value = _CHECKS[key](raw)
        except (TypeError, ValueError) as e:
            raise PolicyError(f"{loc}: key '{key}': {e}") from None
        if _SPELLINGS.get(key) in updates:
            raise PolicyError(f"{loc}: key '{key}': give either {key} or {_SPELLINGS[key]}, not both")
        section, name = _SPELLINGS.get(key, key).split(".", 1)
        values[section][name.replace(".", "_")] = value


def _flatten(doc, where, lines):
    """Turn a parsed YAML mapping into dotted keys, rejecting unknown sections."""
    if doc is None:
        return {}, {}
    if not isinstance(doc, dict):
        raise PolicyError(f"{where}:1: a policy must be a mapping of sections, got {type(doc).__name__}")
    flat, meta = {}, {}
    for key, val in doc.items():
        loc = f"{where}:{lines.get(str(key), 1)}"
        if key in ("version", "name"):
            meta[key] = val
        elif key in _SECTIONS:
            if val is None:
                continue
            if not isinstance(val, dict):
                raise PolicyError(f"{loc}: key '{key}': expected a mapping, got {type(val).__name__}")
            for sub, v in val.items():
                if f"{key}.{sub}" in _NESTED and isinstance(v, dict):
                    flat.update((f"{key}.{sub}.{k}", x) for k, x in v.items())
                else:
                    flat[f"{key}.{sub}"] = v
        else:
            raise PolicyError(f"{loc}: unknown key '{key}' (known: version, name, {', '.join(_SECTIONS)})")
    if "version" in meta and meta["version"] != SCHEMA_VERSION:
        raise PolicyError(f"{where}:{lines.get('version', 1)}: key 'version': "
                          f"this autopatch reads policy version {SCHEMA_VERSION}, got {meta['version']!r}")
    return flat, meta


def _read(path):
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise PolicyError(f"{path}: cannot read policy file: {e.strerror or e}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise PolicyError(f"{path}{line}: YAML syntax error: {problem}") from None
    return doc, _lines(text)


def resolve_path(spec):
    """A builtin name or a path -> (path, display name). Unknown builtins are an error."""
    if os.sep in spec or spec.endswith((".yaml", ".yml")) or Path(spec).exists():
        p = Path(spec)
        if not p.is_file():
            raise PolicyError(f"{spec}: policy file not found")
        return p, str(p)
    p = builtin_dir() / f"{spec}.yaml"
    if not p.is_file():
        raise PolicyError(f"unknown builtin policy '{spec}' (builtins: {', '.join(builtin_names())})")
    return p, spec


def load(spec=None, env_overrides=None, overrides=None):
    """Build the effective Policy.

    ``spec``: builtin name, path, or None for ``default``; ``env_overrides`` and ``overrides``:
    dotted key -> value, applied in that order on top of the file.
    """
    values = {s: {} for s in _SECTIONS}
    origins = {}
    path, display = resolve_path(spec or "default")
    doc, lines = _read(path)
    flat, meta = _flatten(doc, str(path), lines)
    _apply(values, flat, str(path), lines, origins)
    variables = {key: var for var, key in _env.OVERRIDES.items()}
    for key, raw in (env_overrides or {}).items():
        _apply(values, {key: raw}, f"environment variable {variables.get(key, key)}", {}, origins)
    _apply(values, overrides or {}, "enable() argument", {}, origins)
    sections = {s: cls(**values[s]) for s, cls in _SECTIONS.items()}
    _check_algorithm(sections, origins, display)
    name = meta.get("name", Path(path).stem)
    return Policy(name=str(name), source=display, **sections)


def _check_algorithm(sections, origins, display):
    """What the algorithm's keys allow only together: it needs the DDP takeover, and qadam
    warms up for at least one step (its variance is frozen from what warm-up measured)."""
    algorithm, allreduce = sections["algorithm"], sections["allreduce"]
    where = origins.get("algorithm.name", display)
    if algorithm.name != GRADIENT_ALLREDUCE and allreduce.enabled is False:
        raise PolicyError(f"{where}: key 'algorithm.name': {algorithm.name} runs through autopatch's "
                          f"takeover of DistributedDataParallel, which allreduce.enabled: false "
                          f"({origins.get('allreduce.enabled', display)}) turns off")
    if algorithm.name == "qadam" and algorithm.warmup_steps == 0:
        raise PolicyError(f"{origins.get('algorithm.warmup_steps', display)}: key 'algorithm.warmup_steps': "
                          "qadam needs at least 1 warm-up step (its second moment is frozen after them)")


ENABLE_ALIASES = {
    "mode": "fusion.mode", "chunk_bytes": "fusion.chunk_bytes", "exact": "fusion.exact",
    "logdir": "logging.tensorboard_dir", "report": "logging.report", "autotune": "autotune.enabled",
}


def enable_overrides(kwargs):
    """``enable(**kwargs)`` -> dotted keys. Accepts aliases (``mode=``) and sections (``fusion={...}``)."""
    out = {}
    for k, v in kwargs.items():
        if k in _SECTIONS and isinstance(v, dict):   # before aliases: autotune={...} is a section
            out.update({f"{k}.{sub}": val for sub, val in v.items()})
        elif k in ENABLE_ALIASES:
            out[ENABLE_ALIASES[k]] = v
        elif k == "compile":
            raise PolicyError("enable(): 'compile' was removed: use exact='rounding' "
                              "(torch's fused kernels or torch.compile, within float rounding)")
        else:
            raise PolicyError(f"enable(): unknown argument '{k}' (use {', '.join(ENABLE_ALIASES)} "
                              f"or a section mapping: {', '.join(_SECTIONS)})")
    return out
