"""YAML policy -> validated, frozen dataclasses.

Every setting is declared once, as a field of its section's dataclass (``setting(...)``): its
default, its check, what it means, and for the communication algorithm's settings which
algorithms take it. The key checks (``CHECKS``), ``autopatch policy show``, the algorithms'
settings (comm/algorithm_choice.py) and the Bagua classes (contrib/) are all derived from these
declarations; autotune's knobs are records of their own (``tunables.py``).

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
from .tunables import EXPONENT_LIMITS, KNOBS
from .vocabulary import (ALGORITHMS, AUTO, COMPRESSIONS, EXACTNESS, GRADIENT_ALLREDUCE, OFF,
                         PEER_SELECTION_MODES, POLICY_MODES, SWITCHABLE_MODES)

SCHEMA_VERSION = 1


class PolicyError(ValueError):
    """An invalid policy: the message names the file, the line and the key."""


def class_matches(qualname, globs):
    """Class-name globs (include/exclude, force/forbid) match the qualified or the bare name."""
    short = qualname.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(qualname, g) or fnmatch.fnmatchcase(short, g) for g in globs)


# -- checks: each takes a raw value (YAML, a variable's string, an argument) and returns it checked --
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
        if kind is bool and isinstance(v, str) and _env.boolean(v) is not None:
            v = _env.boolean(v)
        if not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
            raise TypeError(f"expected {kind.__name__}, got {type(v).__name__} {v!r}")
        if lo is not None and v < lo:
            raise ValueError(f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise ValueError(f"must be <= {hi}, got {v}")
        return v
    return check


def _optional(check):
    return lambda v: None if v is None or v == "null" else check(v)


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
    return v if v == "auto" else _typed(bool)(v)


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
        _choice(tuple(KNOBS))(k)
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
    if text in ("local", "redis") or text.startswith(("redis://", "rediss://", "unix://")):
        return text
    raise ValueError(f"data cache {value!r}: use 1, local, redis or redis://host:port")


def complexity_spec(spec):
    """``spec`` when it is ``len``, ``module:function`` or a callable, else ValueError (nothing is
    imported: a policy is checked before the program runs)."""
    if spec is None or spec is False:
        return None
    if callable(spec) or spec == "len":
        return spec
    module, sep, attr = str(spec).partition(":")
    if not sep or not module.strip() or not attr.strip():
        raise ValueError(f"a complexity is 'len' or 'module:function', not {spec!r}")
    return spec


def _bounds(v):
    """``{knob: [lo, hi]}`` for exponent knobs, ``{knob: [choices...]}`` for the others."""
    if not isinstance(v, dict):
        raise TypeError(f"expected a mapping of knob -> bounds, got {type(v).__name__}")
    out = []
    for name, b in v.items():
        knob = KNOBS[_choice(tuple(KNOBS))(name)]
        if not isinstance(b, list) or not b:
            raise TypeError(f"{name}: expected a non-empty list, got {b!r}")
        if knob.exponent:
            if len(b) != 2:
                raise ValueError(f"{name}: expected [lo, hi], got {b!r}")
            lo, hi = (_typed(int, *EXPONENT_LIMITS)(x) for x in b)
            if lo > hi:
                raise ValueError(f"{name}: lo {lo} is above hi {hi}")
            out.append((name, (lo, hi)))
            continue
        check = {"mode": lambda x: _mode(x, SWITCHABLE_MODES), "compression": _choice(COMPRESSIONS)}.get(
            name, _typed(bool))
        try:
            out.append((name, tuple(dict.fromkeys(check(x) for x in b))))
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}: {e}") from None
    return tuple(out)


def setting(default, check, doc, *, key=None, applies=None, spellings=None):
    """One policy key, declared once: its ``default``, its ``check``, what it means (``doc``).
    ``key``: its name under the section when not the field's (``cache.backend``); ``applies``:
    for algorithm settings, algorithm name -> an extra check for that algorithm (None: none);
    ``spellings``: other keys that set it, alias -> how the alias's value converts."""
    return field(default=default, metadata={"check": check, "doc": doc, "key": key,
                                            "applies": applies or {}, "spellings": spellings or {}})


def _all_peers(v):
    if v != "all":
        raise ValueError("async model averaging averages over every rank ('all'), as Bagua's did")
    return v


def _qadam_warmup(v):
    if v == 0:
        raise ValueError("qadam needs at least 1 warm-up step (its second moment is frozen after them)")
    return v


# -- the sections -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Optimizers:
    include: tuple = setting(("*",), _globs, "class globs of the optimizers autopatch adopts")
    exclude: tuple = setting((), _globs, "class globs it leaves alone")

    def selects(self, qualname):
        return class_matches(qualname, self.include) and not class_matches(qualname, self.exclude)


@dataclass(frozen=True)
class Fusion:
    mode: str = setting(AUTO, _mode, "off, auto, multi_layer, backward or forward")
    chunk_bytes: object = setting("auto", _chunk, "flat chunk size: a byte count, or auto (per device)")
    exact: str = setting("bitwise", _choice(EXACTNESS),
                         "bitwise, or rounding: torch's fused kernels or torch.compile may step chunks")
    max_deviation: float = setting(1e-6, _typed(float, 0.0),
                                   "rounding: the largest relative deviation per probe step")
    compile_budget_seconds: float = setting(60.0, _typed(float, 0.0),
                                            "rounding: compile time spent before stepping eagerly")
    probe: bool = setting(True, _typed(bool), "check each optimizer class before fusing it")
    force: tuple = setting((), _globs, "class globs fused without the probe")
    forbid: tuple = setting((), _globs, "class globs never fused")
    observe_steps: int = setting(3, _typed(int, 1, 1000), "steps watched before backward or forward may run")
    auto_candidates: object = setting("auto", _auto_candidates,
                                      "the fused modes auto measures against off; auto: all",
                                      spellings={"auto_order": _auto_candidates})
    measure_steps: int = setting(200, _typed(int, 16, 1_000_000), "mode auto: the most steps one measurement takes")


@dataclass(frozen=True)
class Allreduce:
    enabled: object = setting("auto", _auto_bool, "take over DDP's gradient sync: auto, true or false")
    bucket_bytes: int = setting(
        25 * 2**20, _size, "bucket size", spellings={"bucket_size_2p": lambda v: KNOBS["bucket_size_2p"].handle_value(
            _typed(int, 10, 31)(v))})
    compression: str = setting("none", _choice(COMPRESSIONS), "gradients on the wire")
    hierarchical: bool = setting(False, _typed(bool), "reduce within each node first")
    timeout_seconds: object = setting(None, _optional(_typed(float, 0.001)),
                                      "a collective waited on longer is an error; null: the group's timeout")


@dataclass(frozen=True)
class Algorithm:
    """The communication algorithm of DDP models (comm/algorithms/), with Bagua's arguments. A
    setting the algorithm does not take is ignored (the report shows the settings in effect), and
    None means the algorithm's own default."""
    name: str = setting(GRADIENT_ALLREDUCE, _choice(ALGORITHMS), "the algorithm, by Bagua's name")
    hierarchical: object = setting(None, _optional(_typed(bool)),
                                   "null: hierarchical when the job spans several nodes",
                                   applies=dict.fromkeys(a for a in ALGORITHMS if a != "async"))
    peer_selection_mode: str = setting("all", _choice(PEER_SELECTION_MODES), "decentralized: all or shift_one",
                                       applies={"decentralized": None, "async": _all_peers})
    communication_interval: int = setting(1, _typed(int, 1), "local steps between exchanges",
                                          applies={"decentralized": None, "low_precision_decentralized": None})
    sync_interval_ms: int = setting(500, _typed(int, 0), "async: milliseconds between averaging rounds",
                                    applies={"async": None})
    warmup_steps: object = setting(None, _optional(_typed(int, 0)),
                                   "steps of gradient allreduce first (null: the algorithm's default)",
                                   applies={"async": None, "qadam": _qadam_warmup})


@dataclass(frozen=True)
class Autotune:
    enabled: bool = setting(False, _typed(bool), "search the knobs while the job trains")
    knobs: tuple = setting(("mode", "chunk_size_2p", "bucket_size_2p"), _knobs, "the knobs searched")
    warmup_steps: int = setting(10, _typed(int, 0), "steps before the first trial")
    warmup_seconds: float = setting(0.0, _typed(float, 0.0), "seconds before the first trial (both must pass)")
    trial_seconds: float = setting(5.0, _typed(float, 0.0), "how long a trial runs")
    windows: int = setting(5, _typed(int, 1, 100), "a trial's score is the median over this many windows")
    max_samples: int = setting(20, _typed(int, 1, 1000), "the most trials")
    batch_size: object = setting(None, _optional(_typed(int, 1)),
                                 "samples per step on each rank; null: detect, else steps/s")
    bounds: tuple = setting((), _bounds, "knob -> [lo, hi] exponents, or its choices")
    log_csv: object = setting(None, _optional_path, "the trials CSV, in Bagua's layout")
    resume: object = setting(None, _optional_path, "a best-config JSON: skip the search")
    save_best: object = setting(None, _optional_path, "where the best config is saved")

    def bounds_of(self, knob):
        return dict(self.bounds).get(knob, KNOBS[knob].bounds)


@dataclass(frozen=True)
class Data:
    cache_backend: object = setting(None, cache_backend, "null: no cache; local, redis, or redis://host:port URLs",
                                    key="cache.backend", spellings={"cache": cache_backend})
    cache_name: object = setting(None, _optional_path, "prefix of every cache name", key="cache.name")
    cache_capacity: object = setting(None, _optional(_size),
                                     "bytes: the local store's size, or each Redis server's memory",
                                     key="cache.capacity")
    cache_path: object = setting(None, _optional_path, "the local store's directory", key="cache.path")
    load_balance: object = setting(None, complexity_spec, "null, len, or module:function scoring a sample")

    @property
    def wanted(self):
        return self.cache_backend is not None or self.load_balance is not None


@dataclass(frozen=True)
class Logging:
    tensorboard_dir: object = setting(None, _optional_path, "TensorBoard log directory")
    report: object = setting(None, _optional_path, "JSON report path; {rank} becomes the rank")
    summary: bool = setting(True, _typed(bool), "the summary on stderr at exit")


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


SECTIONS = {"optimizers": Optimizers, "fusion": Fusion, "allreduce": Allreduce, "algorithm": Algorithm,
            "autotune": Autotune, "data": Data, "logging": Logging}


@dataclass(frozen=True)
class Key:
    """A dotted policy key, derived from a declaration: where it goes and how it is checked."""
    section: str
    field: str           # the dataclass field it sets
    check: object
    doc: str
    alias: bool = False  # another spelling of the field's key


def _keys():
    keys = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            meta = f.metadata
            keys[f"{section}.{meta['key'] or f.name}"] = Key(section, f.name, meta["check"], meta["doc"])
            for alias, convert in meta["spellings"].items():
                keys[f"{section}.{alias}"] = Key(section, f.name, convert or meta["check"], meta["doc"], alias=True)
    return keys


KEYS = _keys()
# Keys whose value may be a mapping of their own (``data: {cache: {backend: ..., name: ...}}``).
_NESTED = tuple(sorted({k.rsplit(".", 1)[0] for k in KEYS if k.count(".") > 1}))


def algorithm_settings(name):
    """The algorithm settings ``name`` takes: field name -> its extra check for ``name`` (or None)."""
    return {f.name: f.metadata["applies"][name] for f in dataclasses.fields(Algorithm)
            if name in f.metadata["applies"]}


def check_algorithm_name(name, source="the policy"):
    """``name`` when it names a communication algorithm, else a PolicyError saying which do."""
    try:
        return KEYS["algorithm.name"].check(name)
    except (TypeError, ValueError) as e:
        raise PolicyError(f"{source}: unknown communication algorithm {name!r}: {e}") from None


def check_algorithm_setting(name, key, value, source="the policy"):
    """``value`` for setting ``key`` of algorithm ``name``, checked by the declaration; PolicyError else."""
    declared = {f.name: f for f in dataclasses.fields(Algorithm)}
    if key not in declared or name not in declared[key].metadata["applies"]:
        takes = ", ".join(algorithm_settings(name)) or "no settings"
        raise PolicyError(f"{source}: algorithm {name} takes {takes}, not {key}")
    try:
        value = declared[key].metadata["check"](value)
        extra = declared[key].metadata["applies"][name]
        return value if extra is None or value is None else extra(value)
    except (TypeError, ValueError) as e:
        raise PolicyError(f"{source}: key 'algorithm.{key}': {e}") from None


# -- reading a policy -------------------------------------------------------------------------------
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


def _apply(values, updates, where, lines, origins):
    """Validate dotted-key updates and merge them into the nested ``values`` dict; ``origins``
    records where each field was last set, for errors that only a combination of keys shows."""
    _one_spelling_each(updates, where, lines)
    for key, raw in updates.items():
        loc = f"{where}:{lines[key]}" if key in lines else where
        if key in _REPLACED:
            raise PolicyError(f"{loc}: key '{key}': {_REPLACED[key]}")
        if key not in KEYS:
            section = key.split(".")[0]
            known = sorted(k for k in KEYS if k.startswith(section + ".")) or sorted(SECTIONS)
            raise PolicyError(f"{loc}: unknown key '{key}' (known: {', '.join(known)})")
        declared = KEYS[key]
        try:
            value = declared.check(raw)
        except (TypeError, ValueError) as e:
            raise PolicyError(f"{loc}: key '{key}': {e}") from None
        origins[f"{declared.section}.{declared.field}"] = loc
        values[declared.section][declared.field] = value


def _one_spelling_each(updates, where, lines):
    """Two spellings of one setting in one source are an error, named at the other spelling."""
    canonical = {}
    for key in updates:
        if key in KEYS:
            declared = KEYS[key]
            canonical.setdefault(f"{declared.section}.{declared.field}", []).append(key)
    for keys in canonical.values():
        if len(keys) > 1:
            alias = next((k for k in keys if KEYS[k].alias), keys[0])
            other = next(k for k in keys if k != alias)
            loc = f"{where}:{lines[alias]}" if alias in lines else where
            raise PolicyError(f"{loc}: key '{alias}': give either {alias} or {other}, not both")


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
        elif key in SECTIONS:
            if val is None:
                continue
            if not isinstance(val, dict):
                raise PolicyError(f"{loc}: key '{key}': expected a mapping, got {type(val).__name__}")
            flat.update(_dotted(key, val))
        else:
            raise PolicyError(f"{loc}: unknown key '{key}' (known: version, name, {', '.join(SECTIONS)})")
    if "version" in meta and meta["version"] != SCHEMA_VERSION:
        raise PolicyError(f"{where}:{lines.get('version', 1)}: key 'version': "
                          f"this autopatch reads policy version {SCHEMA_VERSION}, got {meta['version']!r}")
    return flat, meta


def _dotted(prefix, mapping):
    """``{sub: value}`` of a section as dotted keys, opening the nested mappings (``data.cache``)."""
    out = {}
    for sub, v in mapping.items():
        key = f"{prefix}.{sub}"
        if key in _NESTED and isinstance(v, dict):
            out.update(_dotted(key, v))
        else:
            out[key] = v
    return out


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
    values = {s: {} for s in SECTIONS}
    origins = {}
    path, display = resolve_path(spec or "default")
    doc, lines = _read(path)
    flat, meta = _flatten(doc, str(path), lines)
    _apply(values, flat, str(path), lines, origins)
    variables = {key: var for var, key in _env.OVERRIDES.items()}
    for key, raw in (env_overrides or {}).items():
        _apply(values, {key: raw}, f"environment variable {variables.get(key, key)}", {}, origins)
    _apply(values, overrides or {}, "enable() argument", {}, origins)
    sections = {s: cls(**values[s]) for s, cls in SECTIONS.items()}
    _check_algorithm(sections, origins, display)
    name = meta.get("name", Path(path).stem)
    return Policy(name=str(name), source=display, **sections)


def _check_algorithm(sections, origins, display):
    """What the algorithm's keys allow only together: it needs the DDP takeover, and each setting
    it takes passes that algorithm's own check (qadam warms up for at least one step)."""
    algorithm, allreduce = sections["algorithm"], sections["allreduce"]
    where = origins.get("algorithm.name", display)
    if algorithm.name != GRADIENT_ALLREDUCE and allreduce.enabled is False:
        raise PolicyError(f"{where}: key 'algorithm.name': {algorithm.name} runs through autopatch's "
                          f"takeover of DistributedDataParallel, which allreduce.enabled: false "
                          f"({origins.get('allreduce.enabled', display)}) turns off")
    for key in algorithm_settings(algorithm.name):
        check_algorithm_setting(algorithm.name, key, getattr(algorithm, key),
                                origins.get(f"algorithm.{key}", display))


ENABLE_ALIASES = {
    "mode": "fusion.mode", "chunk_bytes": "fusion.chunk_bytes", "exact": "fusion.exact",
    "logdir": "logging.tensorboard_dir", "report": "logging.report", "autotune": "autotune.enabled",
}


def enable_overrides(kwargs):
    """``enable(**kwargs)`` -> dotted keys. Accepts aliases (``mode=``) and sections (``fusion={...}``),
    whose nested mappings (``data={"cache": {...}}``) open as in a policy file."""
    out = {}
    for k, v in kwargs.items():
        if k in SECTIONS and isinstance(v, dict):   # before aliases: autotune={...} is a section
            out.update(_dotted(k, v))
        elif k in ENABLE_ALIASES:
            out[ENABLE_ALIASES[k]] = v
        elif k == "compile":
            raise PolicyError("enable(): 'compile' was removed: use exact='rounding' "
                              "(torch's fused kernels or torch.compile, within float rounding)")
        else:
            raise PolicyError(f"enable(): unknown argument '{k}' (use {', '.join(ENABLE_ALIASES)} "
                              f"or a section mapping: {', '.join(SECTIONS)})")
    return out
