"""The effective policy: a builtin or a file, then environment variables, then ``enable()``
arguments, each key checked by its declaration and every error naming where it was given."""

import os
from pathlib import Path

from .. import env as _env
from ..vocabulary import GRADIENT_ALLREDUCE
from .messages import PolicyError, cut, cut_message, shown
from .settings import (KEYS, NESTED, SCHEMA_VERSION, SECTIONS, Policy, algorithm_settings,
                       check_algorithm_setting)
from .yaml_reader import plain_data, read_policy_file

MAX_NAME = 200             # characters of a policy's name


def builtin_dir():
    """Builtin policies: inside the installed package, or beside it in a source checkout."""
    here = Path(__file__).resolve().parent.parent     # the autopatch package
    for cand in (here / "policies", here.parent / "policies"):
        if cand.is_dir():
            return cand
    return here / "policies"


def builtin_names():
    return sorted(p.stem for p in builtin_dir().glob("*.yaml"))


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
            raise PolicyError(f"{loc}: unknown key '{cut(key)}' (known: {', '.join(known)})")
        declared = KEYS[key]
        try:
            value = declared.check(plain_data(raw))
        except (TypeError, ValueError) as e:
            raise PolicyError(f"{loc}: key '{key}': {cut_message(e)}") from None
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
            raise PolicyError(f"{loc}: unknown key '{cut(str(key))}' (known: version, name, {', '.join(SECTIONS)})")
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
        if key in NESTED and isinstance(v, dict):
            out.update(_dotted(key, v))
        else:
            out[key] = v
    return out


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
            raise PolicyError(f"{cut(spec)}: policy file not found")
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
    doc, lines = read_policy_file(path)
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
            raise PolicyError(f"enable(): unknown argument '{cut(k)}' (use {', '.join(ENABLE_ALIASES)} "
                              f"or a section mapping: {', '.join(SECTIONS)})")
    return out
