"""Policies: every builtin loads, precedence holds, and every bad input is one clear PolicyError."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopatch import env, policy, vocabulary
from autopatch.policy import PolicyError
from spawn import clean_env, patience, run_python

REQUIRED = {"default", "safe", "multi_layer", "backward", "forward", "autotune", "distributed", "sharded",
            *vocabulary.ALGORITHMS}


def write(tmp_path, text, name="p.yaml"):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def laughs(levels):
    """A "billion laughs": a list of anchored lists, each holding nine aliases of the one before,
    so the last stands for 9**levels strings."""
    parts = ["&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    parts += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "[" + ", ".join(parts) + "]"


# -- builtins -------------------------------------------------------------------------------------

def test_every_required_builtin_exists():
    assert REQUIRED <= set(policy.builtin_names())


@pytest.mark.parametrize("name", sorted(REQUIRED | set(policy.builtin_names())))
def test_builtin_loads_by_name(name):
    pol = policy.load(name)
    assert pol.name == name and pol.source == name
    assert pol.version == policy.SCHEMA_VERSION
    json.dumps(pol.to_dict(), default=list)


def test_builtins_say_what_their_name_says():
    assert policy.load("safe").fusion.mode == "off"
    assert policy.load("safe").allreduce.enabled is False
    assert policy.load("default").fusion.mode == "auto"
    for mode in ("multi_layer", "backward", "forward"):
        assert policy.load(mode).fusion.mode == mode
    assert policy.load("autotune").autotune.enabled is True
    assert policy.load("distributed").allreduce.enabled is True
    assert policy.load("sharded").fusion.shard is True and policy.load("sharded").fusion.mode == "multi_layer"
    assert policy.load("default").fusion.shard is False
    assert policy.load("default").algorithm.name == "gradient_allreduce"
    for name in vocabulary.ALGORITHMS:
        assert policy.load(name).algorithm.name == name and policy.load(name).allreduce.enabled is True


def test_no_spec_means_default():
    assert policy.load(None).source == "default"


# -- precedence: enable() arguments > environment > policy file > builtin default ------------------

def test_precedence_of_every_layer(tmp_path):
    path = write(tmp_path, "fusion:\n  mode: multi_layer\n  chunk_bytes: 64KiB\nlogging:\n  report: file.json\n")
    assert policy.load("default").fusion.chunk_bytes == "auto"
    from_file = policy.load(str(path))
    assert (from_file.fusion.mode, from_file.fusion.chunk_bytes) == ("multi_layer", 64 * 1024)
    assert from_file.autotune == policy.Autotune()            # untouched sections keep defaults
    env_over = env.policy_overrides({"FUSEDOPT_CHUNK_BYTES": "1MiB", "FUSEDOPT_REPORT": "env.json",
                                     "FUSEDOPT_ENABLE": "1"})
    with_env = policy.load(str(path), env_overrides=env_over)
    assert with_env.fusion.chunk_bytes == 2**20 and with_env.logging.report == "env.json"
    assert with_env.fusion.mode == "multi_layer"                # the file still holds what env leaves
    args = policy.enable_overrides({"chunk_bytes": 4096, "logging": {"summary": False}})
    full = policy.load(str(path), env_overrides=env_over, overrides=args)
    assert full.fusion.chunk_bytes == 4096
    assert full.logging.report == "env.json" and full.logging.summary is False


def _mode_of_sgd(ap, *args, **kwargs):
    ap.enable(*args, **kwargs)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(4))], lr=0.1)
    opt.param_groups[0]["params"][0].grad = torch.ones(4)
    opt.step()
    [entry] = [o for o in ap.report()["optimizers"] if o["steps"]]
    ap.disable()
    return entry["mode"]


def test_precedence_seen_through_enable(ap, tmp_path, monkeypatch):
    off = write(tmp_path, "fusion:\n  mode: 'off'\n", "off.yaml")
    fused = write(tmp_path, "fusion:\n  mode: multi_layer\n", "fused.yaml")
    assert _mode_of_sgd(ap, str(off)) == "off"                # file > builtin default (auto)
    monkeypatch.setenv("FUSEDOPT_POLICY", str(off))
    assert _mode_of_sgd(ap) == "off"                          # FUSEDOPT_POLICY names the file
    monkeypatch.setenv("FUSEDOPT_MODE", "multi_layer")
    assert _mode_of_sgd(ap) == "multi_layer"                  # env > file
    monkeypatch.setenv("FUSEDOPT_MODE", "off")
    assert _mode_of_sgd(ap, str(fused)) == "off"              # env > file, the other way round
    assert _mode_of_sgd(ap, str(fused), mode="multi_layer") == "multi_layer"   # enable() > env


def test_unquoted_off_means_off(tmp_path):
    # YAML 1.1 reads a bare off as false; a user writing the mode's name gets that mode.
    assert policy.load(str(write(tmp_path, "fusion:\n  mode: off\n"))).fusion.mode == "off"


# -- bad input: one PolicyError naming file, line and key ------------------------------------------

BAD = {
    "unknown top-level key": ("version: 1\nfusoin:\n  mode: auto\n", 2, "'fusoin'"),
    "unknown key in a section": ("version: 1\nfusion:\n  mode: auto\n  chunk_size: 4096\n", 4,
                                 "'fusion.chunk_size'"),
    "wrong type": ("autotune:\n  warmup_steps: 3\n  max_samples: many\n", 3, "'autotune.max_samples'"),
    "section is not a mapping": ("version: 1\nlogging: verbose\n", 2, "'logging'"),
    "list expected": ("optimizers:\n  include: 3\n", 2, "'optimizers.include'"),
    "out of range": ("autotune:\n  max_samples: 5000\n", 2, "'autotune.max_samples'"),
    "too small a size": ("allreduce:\n  enabled: true\n  bucket_bytes: 12\n", 3, "'allreduce.bucket_bytes'"),
    "unknown choice": ("fusion:\n  mode: turbo\n", 2, "'fusion.mode'"),
    "newer schema": ("version: 2\nfusion:\n  mode: auto\n", 1, "'version'"),
    "unknown auto candidate": ("fusion:\n  auto_candidates: [backward, turbo]\n", 2,
                               "'fusion.auto_candidates'"),
    "empty auto candidates": ("fusion:\n  auto_candidates: []\n", 2, "'fusion.auto_candidates'"),
    "too few measure steps": ("fusion:\n  measure_steps: 4\n", 2, "'fusion.measure_steps'"),
    "unknown algorithm": ("algorithm:\n  name: gossip\n", 2, "'algorithm.name'"),
    "unknown peer selection": ("algorithm:\n  name: decentralized\n  peer_selection_mode: ring\n", 3,
                               "'algorithm.peer_selection_mode'"),
    "hierarchical neither bool nor null": ("algorithm:\n  hierarchical: sometimes\n", 2,
                                           "'algorithm.hierarchical'"),
    "no interval": ("algorithm:\n  communication_interval: 0\n", 2, "'algorithm.communication_interval'"),
    "qadam without warm-up": ("algorithm:\n  name: qadam\n  warmup_steps: 0\n", 3, "'algorithm.warmup_steps'"),
    "algorithm without the takeover": ("allreduce:\n  enabled: false\nalgorithm:\n  name: async\n", 4,
                                       "'algorithm.name'"),
    "a chunk bound fusion.chunk_bytes refuses": ("autotune:\n  enabled: true\n  bounds:\n    chunk_size_2p: [6, 9]\n",
                                                 3, "'autotune.bounds'"),
    "a bucket bound allreduce.bucket_bytes refuses": ("autotune:\n  bounds: {bucket_size_2p: [9, 20]}\n", 2,
                                                      "'autotune.bounds'"),
    "a bound of no byte count": ("autotune:\n  bounds: {chunk_size_2p: [20, " + "9" * 4000 + "]}\n", 2,
                                 "'autotune.bounds'"),
    "a mode autotune cannot switch to": ("autotune:\n  bounds: {mode: [off, auto]}\n", 2, "'autotune.bounds'"),
    "a bucket exponent allreduce.bucket_bytes refuses": ("allreduce:\n  bucket_size_2p: 9\n", 2,
                                                         "'allreduce.bucket_size_2p'"),
    "both spellings": ("fusion:\n  auto_order: [backward]\n  auto_candidates: [forward]\n", 2,
                       "'fusion.auto_order'"),
    # Numbers that are not numbers, wherever a number is checked.
    "NaN deviation": ("fusion:\n  exact: rounding\n  max_deviation: .nan\n", 3, "'fusion.max_deviation'"),
    "NaN trial seconds": ("autotune:\n  trial_seconds: .nan\n", 2, "'autotune.trial_seconds'"),
    "NaN warm-up seconds": ("autotune:\n  warmup_seconds: .NaN\n", 2, "'autotune.warmup_seconds'"),
    "infinite compile budget": ("fusion:\n  compile_budget_seconds: .inf\n", 2, "'fusion.compile_budget_seconds'"),
    "infinite timeout": ("allreduce:\n  timeout_seconds: .inf\n", 2, "'allreduce.timeout_seconds'"),
    "an integer past Python's digit limit": ("fusion:\n  observe_steps: " + "9" * 5000 + "\n", 2,
                                             "'fusion.observe_steps'"),
    # What yaml.safe_load lets through.
    "a key twice": ("fusion:\n  mode: auto\n  mode: backward\n", 3, "'fusion.mode'"),
    "a section twice": ("fusion:\n  mode: auto\nlogging:\n  report: r.json\nfusion:\n  probe: false\n", 5,
                        "'fusion'"),
    "a nested key twice": ("data:\n  cache:\n    backend: local\n    backend: redis\n", 4,
                           "'data.cache.backend'"),
    "deep nesting": ("fusion:\n  mode: " + "[" * 5000 + "]" * 5000 + "\n", 2, "'fusion.mode'"),
    "deep mappings": ("fusion:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(40)), 16, "'fusion.k0"),
    "laughs in an integer": ("fusion:\n  observe_steps: " + laughs(7) + "\n", 2, "'fusion.observe_steps'"),
    "laughs in a choice": ("fusion:\n  mode: " + laughs(7) + "\n", 2, "'fusion.mode'"),
    "laughs in the version": ("version: " + laughs(7) + "\n", 1, "'version'"),
    "laughs in the name": ("name: " + laughs(7) + "\n", 1, "'name'"),
    "laughs in a list of globs": ("optimizers:\n  include: " + laughs(7) + "\n", 2, "'optimizers.include'"),
    "an alias inside its own node": ("fusion:\n  force: &a [*a]\n", 2, "'fusion.force'"),
    "a name that is a list": ("name: [a, b]\n", 1, "'name'"),
    "a name too long": ("name: " + "n" * 5000 + "\n", 1, "'name'"),
    "invalid UTF-8": (b"version: 1\nname: caf\xe9\n", 2, "not UTF-8"),
    "a NUL character": ("version: 1\nfusion:\n  mode: a\x00b\n", 3, "unacceptable character"),
    # What the run would refuse, known from the text alone.
    "a standard-library cost function": ("data:\n  cache: local\n  load_balance: os:system\n", 3,
                                         "'data.load_balance'"),
    "a builtin cost function": ("data:\n  load_balance: ' builtins : eval'\n", 2, "'data.load_balance'"),
    "a Redis port that is no number": ("data:\n  cache:\n    backend: redis://a:6379,redis://b:x\n", 3,
                                       "'data.cache.backend'"),
    "a Redis server that is no URL": ("data:\n  cache: redis://a:6379,b:6379\n", 2, "'data.cache'"),
    "a cache name longer than a key": ("data:\n  cache:\n    name: " + "n" * 401 + "\n", 3, "'data.cache.name'"),
}


def test_auto_candidates_and_the_older_auto_order_spelling(tmp_path):
    """auto_order (a fixed order, from before auto measured) now names the same candidates."""
    assert policy.load("default").fusion.auto_candidates == "auto"
    new = policy.load(str(write(tmp_path, "fusion:\n  auto_candidates: [off, backward, multi_layer]\n")))
    old = policy.load(str(write(tmp_path, "fusion:\n  auto_order: [backward, forward, multi_layer]\n")))
    assert new.fusion.auto_candidates == ("off", "backward", "multi_layer")
    assert old.fusion.auto_candidates == ("backward", "forward", "multi_layer")
    assert policy.load("default", overrides={"fusion.measure_steps": 64}).fusion.measure_steps == 64


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_policy_names_file_line_and_key(tmp_path, case):
    text, line, key = BAD[case]
    path = write(tmp_path, text)
    with pytest.raises(PolicyError) as err:
        policy.load(str(path))
    msg = str(err.value)
    assert msg.startswith(f"{path}:{line}:"), msg[:1000]
    assert key in msg, msg[:1000]
    assert "\n" not in msg
    assert len(msg) < len(str(path)) + 500, msg[:1000]      # a value is echoed, never expanded


def test_an_autotune_bound_is_checked_by_the_setting_its_knob_sets(tmp_path):
    """A bound stands for a value of a policy setting: the bytes of 2^6 (64) are refused as
    ``fusion.chunk_bytes: 64`` is, with the setting's own words; what the setting takes, a bound
    may say (``allreduce.bucket_bytes`` has no upper limit, so neither has ``bucket_size_2p``)."""
    path = write(tmp_path, "autotune:\n  enabled: true\n  bounds:\n    chunk_size_2p: [6, 9]\n")
    with pytest.raises(PolicyError) as bound:
        policy.load(str(path))
    with pytest.raises(PolicyError) as setting:
        policy.load(str(write(tmp_path, "fusion:\n  chunk_bytes: 64\n", "s.yaml")))
    assert str(bound.value) == (f"{path}:3: key 'autotune.bounds': chunk_size_2p: 6 gives 64 bytes, which "
                                "fusion.chunk_bytes refuses: must be at least 1024 bytes, got 64")
    assert str(setting.value).endswith("must be at least 1024 bytes, got 64")
    taken = policy.load("default", overrides={"autotune.bounds": {"chunk_size_2p": [10, 12], "bucket_size_2p": [10, 36],
                                                                  "compression": ["none", "bf16"]}})
    assert taken.autotune.bounds == (("chunk_size_2p", (10, 12)), ("bucket_size_2p", (10, 36)),
                                     ("compression", ("none", "bf16")))
    assert policy.load("default", overrides={"allreduce.bucket_size_2p": 36}).allreduce.bucket_bytes == 2**36


def test_a_file_larger_than_a_policy_is_refused_unread(tmp_path):
    path = write(tmp_path, "version: 1\n" + "# padding\n" * (policy.MAX_FILE_BYTES // 10))
    with pytest.raises(PolicyError, match=rf"^{path}: a policy file is at most {policy.MAX_FILE_BYTES} bytes"):
        policy.load(str(path))


def test_what_the_strict_loader_still_reads(tmp_path):
    """Anchors, aliases and merge keys within the bound, a numeric name and a byte-order mark
    read as they did through yaml.safe_load."""
    text = ("\ufeffname: 2024\noptimizers:\n  include: &mine [Adam*, SGD]\nfusion:\n  force: *mine\n"
            "autotune:\n  bounds: &b {chunk_size_2p: [10, 12]}\n  knobs: [chunk_size_2p]\n")
    pol = policy.load(str(write(tmp_path, text)))
    assert pol.name == "2024"
    assert pol.optimizers.include == pol.fusion.force == ("Adam*", "SGD")
    assert pol.autotune.bounds_of("chunk_size_2p") == (10, 12)
    merged = policy.load(str(write(tmp_path, "algorithm: &shared {hierarchical: true}\n"
                                              "allreduce: {<<: *shared, enabled: true}\n", "m.yaml")))
    assert merged.allreduce.hierarchical is True and merged.allreduce.enabled is True


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "version: 1\nfusion:\n  mode: auto\n   chunk_bytes: 4096\n")
    with pytest.raises(PolicyError) as err:
        policy.load(str(path))
    assert str(err.value).startswith(f"{path}:4: YAML syntax error"), str(err.value)


@pytest.mark.parametrize("tag", ["!!python/object/apply:os.system", "!!python/object/new:os.system"])
def test_python_tags_are_rejected_not_constructed(tmp_path, tag):
    marker = tmp_path / "constructed"
    path = write(tmp_path, f"version: 1\nfusion: {tag} [\"touch {marker}\"]\n")
    with pytest.raises(PolicyError) as err:
        policy.load(str(path))
    assert str(err.value).startswith(f"{path}:2:"), str(err.value)
    assert not marker.exists()


def test_python_name_tag_is_rejected(tmp_path):
    path = write(tmp_path, "fusion:\n  mode: !!python/name:os.getcwd ''\n")
    with pytest.raises(PolicyError):
        policy.load(str(path))


def test_unknown_builtin_lists_the_builtins():
    with pytest.raises(PolicyError) as err:
        policy.load("backwards")
    msg = str(err.value)
    assert "'backwards'" in msg and "backward" in msg.split("builtins:")[1]


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(PolicyError) as err:
        policy.load(str(missing))
    assert str(missing) in str(err.value) and "not found" in str(err.value)


def test_fusedopt_shard_sets_fusion_shard():
    for value, want in (("1", True), (" on ", True), ("0", False)):
        assert policy.load("default", env_overrides=env.policy_overrides({"FUSEDOPT_SHARD": value})).fusion.shard is want


@pytest.mark.parametrize("var,value,key", [("FUSEDOPT_MODE", "turbo", "fusion.mode"),
                                           ("FUSEDOPT_SHARD", "2", "fusion.shard"),
                                           ("FUSEDOPT_AUTOTUNE", "maybe", "autotune.enabled"),
                                           ("FUSEDOPT_CHUNK_BYTES", "12", "fusion.chunk_bytes"),
                                           ("FUSEDOPT_ALGORITHM", "gossip", "algorithm.name")])
def test_bad_environment_value_names_the_variable(var, value, key):
    with pytest.raises(PolicyError) as err:
        policy.load("default", env_overrides=env.policy_overrides({var: value}))
    assert var in str(err.value) and f"'{key}'" in str(err.value)


@pytest.mark.parametrize("var,value,key,needle", [
    ("FUSEDOPT_AUTOTUNE_TRIAL_SECONDS", "nan", "autotune.trial_seconds", "finite"),
    ("FUSEDOPT_AUTOTUNE_WARMUP_SECONDS", "inf", "autotune.warmup_seconds", "finite"),
    ("FUSEDOPT_AUTOTUNE_WARMUP_SECONDS", "1e999", "autotune.warmup_seconds", "finite"),
    ("FUSEDOPT_AUTOTUNE_TRIAL_SECONDS", "-Infinity", "autotune.trial_seconds", "finite"),
    # os.environ holds bytes that are not UTF-8 as surrogates
    ("FUSEDOPT_LOGDIR", b"/tmp/caf\xe9".decode("utf-8", "surrogateescape"), "logging.tensorboard_dir",
     "not valid UTF-8 text: byte 0xe9"),
    ("FUSEDOPT_MODE", "x" * 100_000, "fusion.mode", "expected one of"),
    ("FUSEDOPT_DATA_BALANCE", "os:system", "data.load_balance", "standard library"),
    ("FUSEDOPT_DATA_BALANCE", "os.path:join", "data.load_balance", "standard library"),
    ("FUSEDOPT_DATA_CACHE", "redis://host:99999", "data.cache", "out of range"),
])
def test_environment_values_get_the_same_checks(var, value, key, needle):
    with pytest.raises(PolicyError) as err:
        policy.load("default", env_overrides=env.policy_overrides({var: value}))
    msg = str(err.value)
    assert var in msg and f"'{key}'" in msg and needle in msg and len(msg) < 500, msg[:1000]


def _shared_lists(levels):
    """A Python value like a YAML alias bomb: nine references to one list, ``levels`` deep."""
    value = ["lol"] * 9
    for _ in range(levels):
        value = [value] * 9
    return value


def _nested(depth):
    value = []
    for _ in range(depth):
        value = [value]
    return value


def _cycle():
    value = []
    value.append(value)
    return value


@pytest.mark.parametrize("kwargs,key,needle", [
    ({"autotune": {"trial_seconds": float("nan")}}, "autotune.trial_seconds", "finite"),
    ({"autotune": {"warmup_seconds": float("nan")}}, "autotune.warmup_seconds", "finite"),
    ({"fusion": {"max_deviation": float("inf")}}, "fusion.max_deviation", "finite"),
    ({"fusion": {"mode": _nested(100_000)}}, "fusion.mode", "nested deeper"),
    ({"fusion": {"force": _cycle()}}, "fusion.force", "nested deeper"),
    ({"fusion": {"mode": _shared_lists(9)}}, "fusion.mode", "larger than a policy"),
    ({"optimizers": {"include": _shared_lists(9)}}, "optimizers.include", "larger than a policy"),
    ({"mode": "multi\udcff"}, "fusion.mode", "not valid UTF-8"),
    ({"fusion": {"observe_steps": 10 ** 5000}}, "fusion.observe_steps", "an int of about 5000 digits"),
    ({"data": {"load_balance": "os:system"}}, "data.load_balance", "standard library"),
    ({"data": {"cache": {"name": "n" * 401}}}, "data.cache.name", "at most 400 bytes"),
])
def test_enable_arguments_get_the_same_checks(ap, kwargs, key, needle):
    with pytest.raises(PolicyError) as err:
        ap.enable(**kwargs)
    msg = str(err.value)
    assert f"'{key}'" in msg and needle in msg and len(msg) < 500, msg[:1000]
    assert not ap.is_enabled()


@pytest.mark.parametrize("spec,needle", [(3, "not int 3"), ("a\x00b", "unknown builtin policy 'a\\x00b'"),
                                         ("x" * 5000, "File name too long")])
def test_a_policy_that_is_no_name_or_path_is_one_error(ap, spec, needle):
    with pytest.raises(PolicyError) as err:
        ap.enable(spec)
    assert needle in str(err.value) and len(str(err.value)) < 500, str(err.value)[:1000]


def test_a_nested_cache_mapping_as_in_the_yaml_form(ap, tmp_path):
    pol = policy.load("default", overrides=policy.enable_overrides(
        {"data": {"cache": {"backend": "local", "name": "x", "path": str(tmp_path)}}}))
    assert (pol.data.cache_backend, pol.data.cache_name, pol.data.cache_path) == ("local", "x", str(tmp_path))
    session = ap.enable(data={"cache": {"backend": "local", "name": "x", "path": str(tmp_path)}})
    assert session.policy.data == pol.data


def test_bad_enable_arguments_leave_autopatch_off(ap):
    with pytest.raises(PolicyError, match="'fusion.mode'"):
        ap.enable(mode="turbo")
    with pytest.raises(PolicyError, match="unknown argument 'bogus'"):
        ap.enable(bogus=1)
    with pytest.raises(PolicyError, match="'fusion.speed'"):
        ap.enable(fusion={"speed": 3})
    assert not ap.is_enabled()


# -- autopatch policy check ----------------------------------------------------------------------

def _cli():
    return [Path(sys.executable).parent / "autopatch"]


def _module():
    return [sys.executable, "-m", "autopatch"]


@pytest.mark.parametrize("launcher", [_cli, _module])
def test_policy_check_prints_the_effective_policy(tmp_path, launcher):
    path = write(tmp_path, "fusion:\n  mode: multi_layer\n  chunk_bytes: 1MiB\n")
    cmd = launcher()
    res = run_python([*cmd[1:], "policy", "check", path], python=cmd[0])
    assert res.returncode == 0, res.stderr
    header, body = res.stdout.split("\n", 1)
    assert header.startswith(f"# {path}: valid")
    shown = json.loads(body)
    assert shown["fusion"]["mode"] == "multi_layer" and shown["fusion"]["chunk_bytes"] == 2**20
    assert shown["allreduce"]["bucket_bytes"] == policy.Allreduce().bucket_bytes


def test_policy_check_applies_environment_only_when_asked(tmp_path):
    env_ = clean_env(FUSEDOPT_MODE="off")
    plain = run_python(["-m", "autopatch", "policy", "check", "multi_layer"], env=env_)
    with_env = run_python(["-m", "autopatch", "policy", "check", "--env", "multi_layer"], env=env_)
    assert json.loads(plain.stdout.split("\n", 1)[1])["fusion"]["mode"] == "multi_layer"
    assert json.loads(with_env.stdout.split("\n", 1)[1])["fusion"]["mode"] == "off"


def _one_gib_of_memory():
    """A subprocess limit, so that a policy check expanding an alias bomb fails here, not the machine."""
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


@pytest.mark.parametrize("case", ["unknown key in a section", "wrong type", "out of range", "NaN trial seconds",
                                  "a key twice", "deep nesting", "laughs in the name", "invalid UTF-8",
                                  "a standard-library cost function", "a Redis port that is no number"])
def test_policy_check_bad_file_exits_2_with_one_message(tmp_path, case):
    text, line, key = BAD[case]
    path = write(tmp_path, text)
    res = run_python(["-m", "autopatch", "policy", "check", path])
    assert res.returncode == 2
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr[-3000:]
    assert f"{path}:{line}:" in lines[0] and key in lines[0]


@pytest.mark.parametrize("where", ["fusion:\n  observe_steps: {}\n", "fusion:\n  mode: {}\n", "version: {}\n",
                                   "name: {}\n"])
def test_policy_check_refuses_a_billion_laughs_at_once(tmp_path, where):
    """9**9 strings if expanded: refused while composing, one line, in the time a check takes."""
    path = write(tmp_path, where.format(laughs(9)))
    res = subprocess.run([sys.executable, "-m", "autopatch", "policy", "check", str(path)], env=clean_env(),
                         capture_output=True, text=True, timeout=patience(20), preexec_fn=_one_gib_of_memory)
    assert res.returncode == 2 and res.stdout == "", res.stderr[-3000:]
    [line] = res.stderr.strip().splitlines()
    assert line.startswith(f"autopatch: invalid policy: {path}:") and "aliases repeat more than" in line


def test_zero_code_start_up_gives_a_deep_policy_the_same_one_error(tmp_path):
    path = write(tmp_path, BAD["deep nesting"][0])
    res = run_python(["-c", "print('the script ran')"], env=clean_env(FUSEDOPT_ENABLE="1", FUSEDOPT_POLICY=path))
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr == f"autopatch: invalid policy: {path}:2: key 'fusion.mode': nested deeper than " \
                         f"{policy.MAX_DEPTH} levels\n"


def test_policy_check_refuses_an_environment_value_that_is_not_utf8(tmp_path):
    env_ = {**clean_env(), "FUSEDOPT_LOGDIR": b"/tmp/caf\xe9"}
    res = run_python(["-m", "autopatch", "policy", "check", "--env", "default"], env=env_)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip() == ("autopatch: invalid policy: environment variable FUSEDOPT_LOGDIR: key "
                                  "'logging.tensorboard_dir': not valid UTF-8 text: byte 0xe9 at character 9")


@pytest.mark.parametrize("spec,needle", [("nosuch", "unknown builtin policy 'nosuch'"),
                                         ("missing.yaml", "not found")])
def test_policy_check_unknown_name_or_missing_file_exits_2(tmp_path, spec, needle):
    res = run_python(["-m", "autopatch", "policy", "check", spec], cwd=tmp_path)
    assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr


def test_what_the_run_may_call_or_reach_checks_as_valid(tmp_path):
    """The name-only rules refuse no cost function of the program's, nor a Redis URL the client takes."""
    path = write(tmp_path, "data:\n  cache:\n    backend: redis://a:6379/0, rediss://b, unix:///tmp/r.sock\n"
                           "    name: " + "n" * 400 + "\n  load_balance: my_costs.tokens:count\n")
    res = run_python(["-m", "autopatch", "policy", "check", path])
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.split("\n", 1)[1])["data"]["load_balance"] == "my_costs.tokens:count"
    assert "my_costs" not in sys.modules


def test_policy_list_names_the_builtins():
    res = run_python(["-m", "autopatch", "policy", "list"])
    assert res.returncode == 0 and REQUIRED <= set(res.stdout.split())
