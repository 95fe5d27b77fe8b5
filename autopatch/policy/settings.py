"""The policy's settings, each declared once as a field of its section's dataclass
(``setting(...)``): its default, its check, what it means, and for the communication
algorithm's settings which algorithms take it. The key table (``KEYS``), the algorithms'
settings (comm/algorithm_choice.py) and the Bagua classes (contrib/) are derived from these
declarations; autotune's knobs are records of their own (``tunables.py``),
bounded by the settings they set."""

import dataclasses
from dataclasses import dataclass, field

from ..tunables import KNOBS
from ..vocabulary import (ALGORITHMS, AUTO, COMPRESSIONS, EXACTNESS, GRADIENT_ALLREDUCE, PEER_SELECTION_MODES)
from .checks import (all_peers, auto_or_bool, byte_count, cache_backend, chunk_size, class_globs, class_matches,
                     complexity_spec, knob_names, mode_candidates, one_of, optional, optional_path, policy_mode,
                     qadam_warmup, short_cache_name, typed)
from .messages import PolicyError, shown

SCHEMA_VERSION = 1


def knob_bounds(v):
    """``{knob: [lo, hi]}`` for exponent knobs, ``{knob: [choices...]}`` for the others; every
    value checked by the setting the knob sets (``knob_value``)."""
    if not isinstance(v, dict):
        raise TypeError(f"expected a mapping of knob -> bounds, got {type(v).__name__}")
    out = []
    for name, b in v.items():
        knob = KNOBS[one_of(tuple(KNOBS))(name)]
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
    value = typed(int)(value)
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


# -- the sections -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Optimizers:
    include: tuple = setting(("*",), class_globs, "class globs of the optimizers autopatch adopts")
    exclude: tuple = setting((), class_globs, "class globs it leaves alone")

    def selects(self, qualname):
        return class_matches(qualname, self.include) and not class_matches(qualname, self.exclude)


@dataclass(frozen=True)
class Fusion:
    mode: str = setting(AUTO, policy_mode, "off, auto, multi_layer, backward or forward")
    chunk_bytes: object = setting("auto", chunk_size, "flat chunk size: a byte count, or auto (per device)")
    exact: str = setting("bitwise", one_of(EXACTNESS),
                         "bitwise, or rounding: torch's fused kernels or torch.compile may step chunks")
    max_deviation: float = setting(1e-6, typed(float, 0.0),
                                   "rounding: the largest relative deviation per probe step")
    compile_budget_seconds: float = setting(60.0, typed(float, 0.0),
                                            "rounding: compile time spent before stepping eagerly")
    probe: bool = setting(True, typed(bool), "check each optimizer class before fusing it")
    force: tuple = setting((), class_globs, "class globs fused without the probe")
    forbid: tuple = setting((), class_globs, "class globs never fused")
    observe_steps: int = setting(3, typed(int, 1, 1000), "steps watched before backward or forward may run")
    auto_candidates: object = setting("auto", mode_candidates,
                                      "the fused modes auto measures against off; auto: all",
                                      spellings={"auto_order": mode_candidates})
    measure_steps: int = setting(200, typed(int, 16, 1_000_000), "mode auto: the most steps one measurement takes")
    shard: bool = setting(False, typed(bool),
                          "across DDP ranks: each rank holds and steps the optimizer state of 1/N of every flat run")


@dataclass(frozen=True)
class Allreduce:
    enabled: object = setting("auto", auto_or_bool, "take over DDP's gradient sync: auto, true or false")
    bucket_bytes: int = setting(
        25 * 2**20, byte_count, "bucket size", spellings={"bucket_size_2p": lambda v: KNOBS["bucket_size_2p"].handle_value(
            knob_value("bucket_size_2p", v))})
    compression: str = setting("none", one_of(COMPRESSIONS), "gradients on the wire")
    hierarchical: bool = setting(False, typed(bool), "reduce within each node first")
    timeout_seconds: object = setting(None, optional(typed(float, 0.001)),
                                      "a collective waited on longer is an error; null: the group's timeout")


@dataclass(frozen=True)
class Algorithm:
    """The communication algorithm of DDP models (comm/algorithms/), with Bagua's arguments. A
    setting the algorithm does not take is ignored (the report shows the settings in effect), and
    None means the algorithm's own default."""
    name: str = setting(GRADIENT_ALLREDUCE, one_of(ALGORITHMS), "the algorithm, by Bagua's name")
    hierarchical: object = setting(None, optional(typed(bool)),
                                   "null: hierarchical when the job spans several nodes",
                                   applies=dict.fromkeys(a for a in ALGORITHMS if a != "async"))
    peer_selection_mode: str = setting("all", one_of(PEER_SELECTION_MODES), "decentralized: all or shift_one",
                                       applies={"decentralized": None, "async": all_peers})
    communication_interval: int = setting(1, typed(int, 1), "local steps between exchanges",
                                          applies={"decentralized": None, "low_precision_decentralized": None})
    sync_interval_ms: int = setting(500, typed(int, 0), "async: milliseconds between averaging rounds",
                                    applies={"async": None})
    warmup_steps: object = setting(None, optional(typed(int, 0)),
                                   "steps of gradient allreduce first (null: the algorithm's default)",
                                   applies={"async": None, "qadam": qadam_warmup})


@dataclass(frozen=True)
class Autotune:
    enabled: bool = setting(False, typed(bool), "search the knobs while the job trains")
    knobs: tuple = setting(("mode", "chunk_size_2p", "bucket_size_2p"), knob_names, "the knobs searched")
    warmup_steps: int = setting(10, typed(int, 0), "steps before the first trial")
    warmup_seconds: float = setting(0.0, typed(float, 0.0), "seconds before the first trial (both must pass)")
    trial_seconds: float = setting(5.0, typed(float, 0.0), "how long a trial runs")
    windows: int = setting(5, typed(int, 1, 100), "a trial's score is the median over this many windows")
    max_samples: int = setting(20, typed(int, 1, 1000), "the most trials")
    batch_size: object = setting(None, optional(typed(int, 1)),
                                 "samples per step on each rank; null: detect, else steps/s")
    bounds: tuple = setting((), knob_bounds, "knob -> [lo, hi] exponents, or its choices")
    log_csv: object = setting(None, optional_path, "the trials CSV, in Bagua's layout")
    resume: object = setting(None, optional_path, "a best-config JSON: skip the search")
    save_best: object = setting(None, optional_path, "where the best config is saved")

    def bounds_of(self, knob):
        return dict(self.bounds).get(knob, KNOBS[knob].bounds)


@dataclass(frozen=True)
class Data:
    cache_backend: object = setting(None, cache_backend, "null: no cache; local, redis, or redis://host:port URLs",
                                    key="cache.backend", spellings={"cache": cache_backend})
    cache_name: object = setting(None, short_cache_name, "prefix of every cache name", key="cache.name")
    cache_capacity: object = setting(None, optional(byte_count),
                                     "bytes: the local store's size, or each Redis server's memory",
                                     key="cache.capacity")
    cache_path: object = setting(None, optional_path, "the local store's directory", key="cache.path")
    load_balance: object = setting(None, complexity_spec, "null, len, or module:function scoring a sample")

    @property
    def wanted(self):
        return self.cache_backend is not None or self.load_balance is not None


@dataclass(frozen=True)
class Logging:
    tensorboard_dir: object = setting(None, optional_path, "TensorBoard log directory")
    report: object = setting(None, optional_path, "JSON report path; {rank} becomes the rank")
    summary: bool = setting(True, typed(bool), "the summary on stderr at exit")
    breakdown: bool = setting(True, typed(bool), "where each step's time goes, and advice, in the report")


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
NESTED = tuple(sorted({k.rsplit(".", 1)[0] for k in KEYS if k.count(".") > 1}))


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
