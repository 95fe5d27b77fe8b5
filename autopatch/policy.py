"""YAML policy -> validated, frozen dataclasses.

Every setting is declared once, as a field of its section's dataclass (``setting(...)``): its
default, its check, what it means, and for the communication algorithm's settings which
algorithms take it. The key checks (``CHECKS``), ``autopatch policy show``, the algorithms'
settings (comm/algorithm_choice.py) and the Bagua classes (contrib/) are all derived from these
declarations; autotune's knobs are records of their own (``tunables.py``).

A policy is read with ``yaml.safe_load`` semantics only (it can never build Python objects), by
a loader that also refuses what safe_load lets through: a key given twice, nesting past
``MAX_DEPTH``, aliases that would repeat more than ``MAX_REPEATED`` (a "billion laughs"), a file
over ``MAX_FILE_BYTES`` or not UTF-8. It is then checked key by key; every error names the file,
the line and the dotted key, and echoes at most ``SHOWN`` characters of a value. Environment
variables and ``enable()`` arguments pass the same checks (``_plain``, then the key's own).
Precedence, lowest first: builtin defaults < policy file < environment < ``enable()`` arguments.
"""

import dataclasses
import fnmatch
import math
import os
import re
import reprlib
import sys
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import env as _env
from .tunables import KNOBS
from .vocabulary import (ALGORITHMS, AUTO, COMPRESSIONS, EXACTNESS, GRADIENT_ALLREDUCE, OFF,
                         PEER_SELECTION_MODES, POLICY_MODES, SWITCHABLE_MODES)

SCHEMA_VERSION = 1
MAX_FILE_BYTES = 1 << 20   # a policy is a few hundred bytes
MAX_DEPTH = 16             # the deepest policy value is 4 levels down (data: cache: backend:)
MAX_REPEATED = 10_000      # nodes and characters all aliases of a file may repeat, in all
MAX_NAME = 200             # characters of a policy's name
SHOWN = 80                 # characters of a value an error message echoes


class PolicyError(ValueError):
    """An invalid policy: the message names the file, the line and the key."""


def shown(value):
    """``repr(value)`` cut to ``SHOWN`` characters: an error message never echoes a whole value
    (reprlib stops early inside long or deeply nested ones, and at cycles)."""
    try:
        text = _REPR.repr(value)
    except ValueError:        # an int past Python's digit limit for str()
        text = f"<an int of about {int(value.bit_length() * 0.30103)} digits>"
    return text if len(text) <= SHOWN else text[:SHOWN - 3] + "..."


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, SHOWN, SHOWN
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


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
            raise ValueError(f"expected one of {', '.join(map(str, options))}; got {shown(v)}")
        return v
    return check


def _typed(kind, lo=None, hi=None):
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


def _cache_name(v):
    v = _optional_path(v)
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


# Modules that are no program's own: a cost function named in one is never called (data/complexity.py).
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


def _bounds(v):
    """``{knob: [lo, hi]}`` for exponent knobs, ``{knob: [choices...]}`` for the others; every
    value checked by the setting the knob sets (``knob_value``)."""
    if not isinstance(v, dict):
        raise TypeError(f"expected a mapping of knob -> bounds, got {type(v).__name__}")
    out = []
    for name, b in v.items():
        knob = KNOBS[_choice(tuple(KNOBS))(name)]
        if not isinstance(b, list) or not b:
            raise TypeError(f"{name}: expected a non-empty list, got {shown(b)}")
        if knob.exponent and len(b) != 2:
            raise ValueError(f"{name}: expected [lo, hi], got {shown(b)}")
        try:
            values = tuple(knob_value(name, x) for x in b)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}: {e}") from None
        if knob.exponent and values[0] > values[1]:
            raise ValueError(f"{name}: lo {values[0]} is above hi {values[1]}")
        out.append((name, values if knob.exponent else tuple(dict.fromkeys(values))))
    return tuple(out)


def knob_value(name, value):
    """``value`` of autotune's knob ``name`` when the setting the knob sets takes what it stands
    for (an exponent's 2^value bytes), and the knob can switch to it while the job runs; else a
    ValueError. A knob has no limits of its own: the setting's declaration is the only one."""
    knob = KNOBS[name]
    check = KEYS[knob.setting].check
    if not knob.exponent:
        value = check(value)
        if value not in knob.bounds:
            raise ValueError(f"{shown(value)} is not one it switches to while the job runs "
                             f"(those are {', '.join(map(str, knob.bounds))})")
        return value
    value = _typed(int)(value)
    if not 0 <= value < 64:
        raise ValueError(f"2^{shown(value)} bytes is not a byte count in 64 bits")
    nbytes = knob.handle_value(value)
    try:
        check(nbytes)
    except ValueError as e:
        raise ValueError(f"{value} gives {nbytes} bytes, which {knob.setting} refuses: {e}") from None
    return value


def check_setting(key, value):
    """``value`` for policy key ``key``, checked by its declaration: what the run-time setters
    (``handle.set_chunk_bytes``, ``session.allreduce.set_bucket_bytes``, ...) take; a TypeError or
    ValueError naming the key else."""
    try:
        return KEYS[key].check(value)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{key}: {e}") from None


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
            knob_value("bucket_size_2p", v))})
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
    cache_name: object = setting(None, _cache_name, "prefix of every cache name", key="cache.name")
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
    breakdown: bool = setting(False, _typed(bool), "where each step's time goes, and advice, in the report")


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
        raise PolicyError(f"{source}: unknown communication algorithm {shown(name)}: {e}") from None


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


class _Refused(yaml.MarkedYAMLError):
    """What ``_StrictLoader`` refuses beyond what PyYAML does: the problem names the key."""


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader (plain data only), bounded: nesting past ``MAX_DEPTH`` and aliases
    repeating more than ``MAX_REPEATED`` nodes and characters in all are refused while composing,
    before anything is expanded; so are an alias inside the node it names (a cycle) and integers
    past Python's digit limit."""

    def __init__(self, text):
        super().__init__(text)
        self._path = []       # the keys above the node being composed (None: a list item or a key)
        self._sizes = {}      # id(node) -> the nodes and characters it stands for, expanded
        self._repeated = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            if event.anchor in self.anchors:     # else the composer's own error
                self._repeat(event)
            return super().compose_node(parent, index)
        self._path.append(index.value if isinstance(index, yaml.ScalarNode) else None)
        try:
            if len(self._path) > MAX_DEPTH:
                self._refuse(f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
            node = super().compose_node(parent, index)
        finally:
            self._path.pop()
        self._sizes[id(node)] = self._size(node)
        return node

    def _refuse(self, problem, mark):
        key = ".".join(k for k in self._path if isinstance(k, str))
        raise _Refused(problem=f"key '{_cut(key)}': {problem}" if key else problem, problem_mark=mark)

    def _size(self, node):
        if isinstance(node, yaml.ScalarNode):
            return 1 + len(node.value)
        children = node.value if isinstance(node, yaml.SequenceNode) else [n for kv in node.value for n in kv]
        return 1 + sum(self._sizes[id(child)] for child in children)

    def _repeat(self, event):
        size = self._sizes.get(id(self.anchors[event.anchor]))
        if size is None:
            self._refuse(f"alias *{_cut(event.anchor)} inside the node it names", event.start_mark)
        self._repeated += size
        if self._repeated > MAX_REPEATED:
            self._refuse(f"aliases repeat more than {MAX_REPEATED} nodes and characters in all "
                         "(a policy needs a few)", event.start_mark)

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:     # more digits than int() takes
            raise _Refused(problem=f"an integer of {len(node.value)} digits", problem_mark=node.start_mark) from None


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)


def _key_lines(root, where):
    """Map dotted key -> 1-based line of that key; a key given twice in one mapping is an error."""
    out = {}

    def walk(node, prefix):
        if isinstance(node, yaml.SequenceNode):
            for child in node.value:
                walk(child, prefix)
        if not isinstance(node, yaml.MappingNode):
            return
        first = {}
        for k, v in node.value:
            if k.tag == "tag:yaml.org,2002:merge" or not isinstance(k, yaml.ScalarNode):
                walk(v, prefix)
                continue
            key, line = f"{prefix}{k.value}", k.start_mark.line + 1
            if (k.tag, k.value) in first:
                raise PolicyError(f"{where}:{line}: key '{_cut(key)}' is given twice in one mapping "
                                  f"(first on line {first[k.tag, k.value]})")
            first[k.tag, k.value] = out[key] = line
            walk(v, key + ".")
    walk(root, "")
    return out


def _cut(text):
    """A key or name as given, cut to ``SHOWN`` characters for a message."""
    return text if len(text) <= SHOWN else text[:SHOWN - 3] + "..."


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
            raise PolicyError(f"{loc}: unknown key '{_cut(key)}' (known: {', '.join(known)})")
        declared = KEYS[key]
        try:
            value = declared.check(_plain(raw))
        except (TypeError, ValueError) as e:
            raise PolicyError(f"{loc}: key '{key}': {_cut_message(e)}") from None
        origins[f"{declared.section}.{declared.field}"] = loc
        values[declared.section][declared.field] = value


def _plain(value):
    """``value`` when it is plain data a policy could hold: nested at most ``MAX_DEPTH`` deep, at
    most ``MAX_FILE_BYTES`` nodes and characters in all (a value of shared lists counts each
    time it is reached), text that is valid UTF-8 (an environment variable holding other bytes
    arrives with surrogates). The checks a policy file gets from its loader, for variables and
    ``enable()`` arguments; ValueError else."""
    budget, stack = MAX_FILE_BYTES, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
        items = [*v.keys(), *v.values()] if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else ()
        budget -= 1 + len(items) + (len(v) if isinstance(v, str) else 0)
        if budget < 0:
            raise ValueError(f"larger than a policy may be ({MAX_FILE_BYTES} nodes and characters)")
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                code = ord(v[e.start])     # 0xdc80-0xdcff: a byte os.environ could not decode
                what = f"byte 0x{code - 0xdc00:02x}" if 0xdc80 <= code <= 0xdcff else f"U+{code:04X}"
                raise ValueError(f"not valid UTF-8 text: {what} at character {e.start + 1}") from None
        stack.extend((item, depth + 1) for item in items)
    return value


def _cut_message(error):
    """A check's message, cut to a few hundred characters (checks echo values through ``shown``;
    this bounds any that do not)."""
    text = str(error)
    return text if len(text) <= 4 * SHOWN else text[:4 * SHOWN - 3] + "..."


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
            raise PolicyError(f"{loc}: unknown key '{_cut(str(key))}' (known: version, name, {', '.join(SECTIONS)})")
    if "version" in meta and (meta["version"] != SCHEMA_VERSION or isinstance(meta["version"], bool)):
        raise PolicyError(f"{where}:{lines.get('version', 1)}: key 'version': "
                          f"this autopatch reads policy version {SCHEMA_VERSION}, got {shown(meta['version'])}")
    if "name" in meta:
        meta["name"] = _name(meta["name"], f"{where}:{lines.get('name', 1)}")
    return flat, meta


def _name(value, loc):
    """A policy's name: a short piece of text (a YAML number is taken as written)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise PolicyError(f"{loc}: key 'name': expected a string, got {type(value).__name__} {shown(value)}")
    text = str(value)      # the loader refuses integers too long for str()
    if not text or len(text) > MAX_NAME or not text.isprintable():
        raise PolicyError(f"{loc}: key 'name': expected a printable name of 1 to {MAX_NAME} characters, "
                          f"got {shown(value)}")
    return text


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
    """(the parsed document, dotted key -> line): at most ``MAX_FILE_BYTES`` of UTF-8, through
    ``_StrictLoader``, composed once for both."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise PolicyError(f"{path}: cannot read policy file: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise PolicyError(f"{path}: a policy file is at most {MAX_FILE_BYTES} bytes; this one is larger")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line, line_start = data.count(b"\n", 0, e.start) + 1, data.rfind(b"\n", 0, e.start) + 1
        raise PolicyError(f"{path}:{line}: not UTF-8 text: byte 0x{data[e.start]:02x} at column "
                          f"{e.start - line_start + 1}") from None
    lines = {}
    try:
        loader = _StrictLoader(text)
        try:
            root = loader.get_single_node()
            lines = _key_lines(root, path)
            return None if root is None else loader.construct_document(root), lines
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        raise PolicyError(_yaml_error(path, e, text, lines)) from None


def _yaml_error(path, error, text, lines):
    """``path:line: problem``: the line the error points at, the key on that line when the
    document was composed, and PyYAML's own refusals called syntax errors."""
    problem = _cut_message(getattr(error, "problem", None) or str(error).splitlines()[0])
    if not isinstance(error, _Refused):
        problem = f"YAML syntax error: {problem}"
    mark = getattr(error, "problem_mark", None)
    position = getattr(error, "position", None)    # the reader's: a character YAML does not allow
    if mark is not None:
        line = mark.line + 1
    elif position is not None:
        line = text.count("\n", 0, position) + 1
    else:
        return f"{path}: {problem}"
    on_line = [key for key, at in lines.items() if at == line]
    if on_line and not problem.startswith("key '"):
        problem = f"key '{_cut(max(on_line, key=len))}': {problem}"
    return f"{path}:{line}: {problem}"


def resolve_path(spec):
    """A builtin name or a path -> (path, display name). Unknown builtins are an error."""
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str):
        raise PolicyError(f"a policy is a builtin name or a path, not {type(spec).__name__} {shown(spec)}")
    try:
        return _resolve(spec)
    except PolicyError:
        raise
    except (OSError, ValueError) as e:      # a name too long, a NUL byte
        raise PolicyError(f"{shown(spec)}: cannot read policy file: {getattr(e, 'strerror', None) or e}") from None


def _resolve(spec):
    """``resolve_path`` for a string, which may still be no path the OS takes (OSError, ValueError)."""
    if os.sep in spec or spec.endswith((".yaml", ".yml")) or Path(spec).exists():
        p = Path(spec)
        if not p.is_file():
            raise PolicyError(f"{_cut(spec)}: policy file not found")
        return p, str(p)
    p = builtin_dir() / f"{spec}.yaml"
    if not p.is_file():
        raise PolicyError(f"unknown builtin policy {shown(spec)} (builtins: {', '.join(builtin_names())})")
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
    return Policy(name=meta.get("name", Path(path).stem), source=display, **sections)


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
            raise PolicyError(f"enable(): unknown argument '{_cut(k)}' (use {', '.join(ENABLE_ALIASES)} "
                              f"or a section mapping: {', '.join(SECTIONS)})")
    return out
