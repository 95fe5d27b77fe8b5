"""Policies: every builtin loads, precedence holds, and every bad input is one clear PolicyError."""

import json
import sys
from pathlib import Path

import pytest
import torch

from autopatch import env, policy, vocabulary
from autopatch.policy import PolicyError
from spawn import clean_env, run_python

REQUIRED = {"default", "safe", "multi_layer", "backward", "forward", "autotune", "distributed",
            *vocabulary.ALGORITHMS}


def write(tmp_path, text, name="p.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


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
    "both spellings": ("fusion:\n  auto_order: [backward]\n  auto_candidates: [forward]\n", 2,
                       "'fusion.auto_order'"),
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
    assert msg.startswith(f"{path}:{line}:"), msg
    assert key in msg, msg
    assert "\n" not in msg


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


@pytest.mark.parametrize("var,value,key", [("FUSEDOPT_MODE", "turbo", "fusion.mode"),
                                           ("FUSEDOPT_AUTOTUNE", "maybe", "autotune.enabled"),
                                           ("FUSEDOPT_CHUNK_BYTES", "12", "fusion.chunk_bytes"),
                                           ("FUSEDOPT_ALGORITHM", "gossip", "algorithm.name")])
def test_bad_environment_value_names_the_variable(var, value, key):
    with pytest.raises(PolicyError) as err:
        policy.load("default", env_overrides=env.policy_overrides({var: value}))
    assert var in str(err.value) and f"'{key}'" in str(err.value)


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


@pytest.mark.parametrize("case", ["unknown key in a section", "wrong type", "out of range"])
def test_policy_check_bad_file_exits_2_with_one_message(tmp_path, case):
    text, line, key = BAD[case]
    path = write(tmp_path, text)
    res = run_python(["-m", "autopatch", "policy", "check", path])
    assert res.returncode == 2
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert f"{path}:{line}:" in lines[0] and key in lines[0]


@pytest.mark.parametrize("spec,needle", [("nosuch", "unknown builtin policy 'nosuch'"),
                                         ("missing.yaml", "not found")])
def test_policy_check_unknown_name_or_missing_file_exits_2(tmp_path, spec, needle):
    res = run_python(["-m", "autopatch", "policy", "check", spec], cwd=tmp_path)
    assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr


def test_policy_list_names_the_builtins():
    res = run_python(["-m", "autopatch", "policy", "list"])
    assert res.returncode == 0 and REQUIRED <= set(res.stdout.split())
