"""Zero-code mode in real subprocesses with the installed package: FUSEDOPT_ENABLE, the launchers,
bad policies, strict mode, the report file, torchrun workers, and a wheel in a fresh venv."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from spawn import IMPORT_PATH, ROOT, SUPPORT, clean_env, patience, run_python, site_packages, write_script

pytestmark = pytest.mark.usefixtures("installed")

TRAIN = """
    import json, sys
    loaded_first = "autopatch" in sys.modules
    torch_first = "torch" in sys.modules
    import autopatch
    print(json.dumps({"loaded": loaded_first, "torch": torch_first, "enabled": autopatch.is_enabled()}),
          flush=True)
    import torch
    from training import batches, mlp, train
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, opt, batches(3))
"""

FIRST = """
    print("first line", flush=True)
    import autopatch
    print(autopatch.is_enabled())
"""


def test_enabled_before_the_first_line_with_summary_and_report(tmp_path):
    script = write_script(tmp_path / "train.py", TRAIN)
    res = run_python([script], cwd=tmp_path,
                     env=clean_env(FUSEDOPT_ENABLE="1", FUSEDOPT_REPORT=tmp_path / "out" / "r{rank}.json"))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.splitlines()[0]) == {"loaded": True, "torch": False, "enabled": True}
    assert "autopatch: policy default, 1 optimizer(s)" in res.stderr
    assert "torch.optim.sgd.SGD:" in res.stderr and "3 steps" in res.stderr
    report = json.loads((tmp_path / "out" / "r0.json").read_text())
    assert report["version"] == 1 and report["policy"] == "default" and report["rank"] == 0
    [opt] = report["optimizers"]
    assert opt["class"] == "torch.optim.sgd.SGD" and opt["steps"] == 3 and opt["params"] == 14
    assert opt["mode"] in ("off", "multi_layer", "backward", "forward") and opt["reason"]


@pytest.mark.parametrize("value", [None, "", "  ", "0", "false", " FALSE ", "False"])
def test_not_enabled_imports_nothing(value):
    env = clean_env() if value is None else clean_env(FUSEDOPT_ENABLE=value)
    code = "import sys; print(sorted(m for m in ('autopatch', 'torch', 'yaml', 'wrapt') if m in sys.modules))"
    res = run_python(["-c", code], env=env)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr
    assert res.stderr == ""


@pytest.mark.parametrize("value", ["1", "true", " TRUE ", "True", "\t1\n", "yes", "On"])
def test_enabled_imports_autopatch_but_not_torch(value):
    code = "import sys, autopatch; print('torch' in sys.modules, autopatch.is_enabled())"
    res = run_python(["-c", code], env=clean_env(FUSEDOPT_ENABLE=value))
    assert res.stdout.split() == ["False", "True"], res.stderr
    assert res.stderr == ""


@pytest.mark.parametrize("value", ["2", "enable", "-1", "1.0", "t rue", "ture"])
def test_a_value_not_understood_warns_once_and_stays_off(tmp_path, value):
    script = write_script(tmp_path / "first.py", FIRST)
    res = run_python([script], cwd=tmp_path, env=clean_env(FUSEDOPT_ENABLE=value))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["first", "line", "False"]
    assert res.stderr.splitlines() == [f"autopatch: FUSEDOPT_ENABLE={value!r} is not understood (use 1, "
                                       "true, yes or on to enable, 0, false, no or off not to); autopatch stays off"]


def test_strict_makes_a_value_not_understood_fatal(tmp_path):
    script = write_script(tmp_path / "first.py", FIRST)
    res = run_python([script], cwd=tmp_path, env=clean_env(FUSEDOPT_ENABLE="ture", FUSEDOPT_STRICT="1"))
    assert res.returncode == 1 and res.stdout == ""
    assert "FUSEDOPT_ENABLE='ture' is not understood" in res.stderr and "FUSEDOPT_STRICT=1" in res.stderr


@pytest.mark.parametrize("value", ["1", "yes"])
def test_pth_line_is_harmless_once_the_package_is_gone(tmp_path, installed, value):
    """The .pth left behind in a site-packages without autopatch: nothing happens, nothing is said."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    purelib = Path(run_python(["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              python=python).stdout.strip())
    (purelib / "autopatch.pth").write_text(installed.read_text())
    env = clean_env(FUSEDOPT_ENABLE=value)
    del env["PYTHONPATH"]
    res = run_python(["-c", "import sys; print('autopatch' in sys.modules)"], python=python, env=env, cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == "False" and res.stderr == "", res.stderr


def test_pth_line_is_one_cheap_guarded_line(installed):
    lines = [l for l in installed.read_text().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("import os;")
    assert "FUSEDOPT_ENABLE" in lines[0] and "find_spec" in lines[0]


@pytest.mark.parametrize("policy_text,extra,needles", [
    ("version: 1\nfusion:\n  mode: auto\n  chunk_size: 4096\n", {}, [":4:", "'fusion.chunk_size'"]),
    ("autotune:\n  max_samples: 0\n", {}, [":2:", "'autotune.max_samples'"]),
    (None, {"FUSEDOPT_POLICY": "no_such_builtin"}, ["unknown builtin policy 'no_such_builtin'"]),
    (None, {"FUSEDOPT_MODE": "turbo"}, ["FUSEDOPT_MODE", "'fusion.mode'"]),
    (None, {"FUSEDOPT_AUTOTUNE": "maybe"}, ["FUSEDOPT_AUTOTUNE", "'autotune.enabled'"]),
])
def test_bad_policy_stops_before_the_script(tmp_path, policy_text, extra, needles):
    script = write_script(tmp_path / "first.py", FIRST)
    env = clean_env(FUSEDOPT_ENABLE="1", **extra)
    if policy_text is not None:
        (tmp_path / "bad.yaml").write_text(policy_text)
        env["FUSEDOPT_POLICY"] = str(tmp_path / "bad.yaml")
        needles = [str(tmp_path / "bad.yaml") + needles[0], *needles[1:]]
    res = run_python([script], env=env, cwd=tmp_path)
    assert res.returncode == 2
    assert res.stdout == ""
    assert res.stderr.startswith("autopatch: invalid policy: ") and "Traceback" not in res.stderr
    for needle in needles:
        assert needle in res.stderr, res.stderr


def _broken(tmp_path, module):
    """A real broken install: ``module`` on the path fails to import."""
    pkg = tmp_path / "broken" / module
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"raise ImportError('{module} is broken')\n")
    return f"{tmp_path / 'broken'}{os.pathsep}{IMPORT_PATH}"


@pytest.mark.parametrize("module", ["wrapt", "yaml"])
def test_start_up_failure_warns_and_runs_unpatched(tmp_path, module):
    script = write_script(tmp_path / "first.py", FIRST)
    res = run_python([script], cwd=tmp_path,
                     env=clean_env(FUSEDOPT_ENABLE="1", PYTHONPATH=_broken(tmp_path, module)))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["first", "line", "False"]
    assert f"autopatch: not enabled, start-up failed: ImportError: {module} is broken" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("module", ["wrapt", "yaml"])
def test_strict_makes_a_start_up_failure_fatal(tmp_path, module):
    script = write_script(tmp_path / "first.py", FIRST)
    res = run_python([script], cwd=tmp_path, env=clean_env(
        FUSEDOPT_ENABLE="1", FUSEDOPT_STRICT="1", PYTHONPATH=_broken(tmp_path, module)))
    assert res.returncode == 1
    assert res.stdout == ""
    assert f"ImportError: {module} is broken" in res.stderr and "FUSEDOPT_STRICT=1" in res.stderr


def test_unpatched_program_still_trains_after_a_start_up_failure(tmp_path):
    script = write_script(tmp_path / "train.py", TRAIN)
    res = run_python([script], cwd=tmp_path,
                     env=clean_env(FUSEDOPT_ENABLE="1", PYTHONPATH=_broken(tmp_path, "wrapt")))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.splitlines()[0])["enabled"] is False
    assert "optimizer(s)" not in res.stderr


ARGV = """
    import json, sys
    import autopatch
    print(json.dumps({"argv": sys.argv, "name": __name__, "enabled": autopatch.is_enabled(),
                      "policy": autopatch.report()["policy"], "path0": sys.path[0]}))
"""


@pytest.mark.parametrize("launcher", ["console", "module"])
def test_launcher_runs_the_script_enabled_with_its_arguments(tmp_path, launcher):
    script = write_script(tmp_path / "job.py", ARGV)
    args = ["--steps", "3", "-x", "value with space", "pos"]
    if launcher == "console":   # autopatch run --policy safe job.py ARGS
        cmd, python = ["run", "--policy", "safe", script, *args], Path(sys.executable).parent / "autopatch"
    else:                       # python -m autopatch --policy safe job.py ARGS
        cmd, python = ["-m", "autopatch", "--policy", "safe", script, *args], sys.executable
    res = run_python(cmd, python=python, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["argv"] == [str(script), *args]
    assert out["name"] == "__main__" and out["enabled"] is True and out["policy"] == "safe"
    assert out["path0"] == str(tmp_path)


def test_enable_bagua_net_sets_nccls_socket_transport_and_says_so(tmp_path):
    script = write_script(tmp_path / "job.py", "import os\nprint(os.environ['NCCL_SOCKET_NTHREADS'], "
                                               "os.environ['NCCL_NSOCKS_PERTHREAD'])\n")
    res = run_python(["-m", "autopatch", "run", "--enable_bagua_net", "--policy", "safe", script],
                     env=clean_env(NCCL_SOCKET_NTHREADS="2"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["2", "4"]                # a value the user set is kept
    assert "Bagua-Net cannot load" in res.stderr and "NCCL_NSOCKS_PERTHREAD=4" in res.stderr


def test_launcher_module_form_and_bad_policy(tmp_path):
    (tmp_path / "jobmod.py").write_text("import sys, autopatch\nprint(sys.argv[1:], __name__, autopatch.is_enabled())\n")
    env = clean_env(PYTHONPATH=f"{tmp_path}:{SUPPORT}")
    res = run_python(["-m", "autopatch", "run", "-m", "jobmod", "a", "--b"], env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "['a', '--b'] __main__ True"
    bad = run_python(["-m", "autopatch", "run", "--policy", "nosuch", tmp_path / "jobmod.py"], env=env)
    assert bad.returncode == 2 and bad.stdout == "" and "'nosuch'" in bad.stderr


DIST = """
    import json, sys
    import autopatch
    import torch
    import torch.distributed as dist
    from training import batches, mlp, train
    dist.init_process_group("gloo")
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = batches(4, seed=10 + dist.get_rank())
    train(model, opt, data)
    # one write per line: print() writes the text and the newline apart, and the two ranks'
    # lines could interleave on the shared pipe
    sys.stdout.write(json.dumps({"rank": dist.get_rank(), "enabled": autopatch.is_enabled()}) + "\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_workers_are_enabled_and_each_writes_its_report(tmp_path):
    script = write_script(tmp_path / "dist.py", DIST)
    env = clean_env(FUSEDOPT_ENABLE="1", FUSEDOPT_REPORT=tmp_path / "report_{rank}.json", OMP_NUM_THREADS="1")
    res = run_python(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                      "--master_port", _free_port(), script], env=env, cwd=tmp_path, timeout=patience(240))
    assert res.returncode == 0, res.stdout + res.stderr
    seen = sorted(json.loads(l)["rank"] for l in res.stdout.splitlines() if l.startswith("{"))
    assert seen == [0, 1]
    assert all(json.loads(l)["enabled"] for l in res.stdout.splitlines() if l.startswith("{"))
    for rank in (0, 1):
        report = json.loads((tmp_path / f"report_{rank}.json").read_text())
        assert report["rank"] == rank
        [opt] = report["optimizers"]     # the launcher, which has no optimizer, writes nothing
        assert opt["class"] == "torch.optim.adam.Adam" and opt["steps"] == 4
    assert res.stderr.count("optimizer(s)") == 2


WHEEL_CHECK = """
    import json, sys
    import autopatch
    from autopatch import policy
    enabled = autopatch.is_enabled()
    import torch
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    for _ in range(2):
        p.grad = torch.ones(3)
        opt.step()
    print(json.dumps({"enabled": enabled, "file": autopatch.__file__, "builtin_dir": str(policy.builtin_dir()),
                      "names": policy.builtin_names(), "safe": policy.load("safe").fusion.mode,
                      "steps": [o["steps"] for o in autopatch.report()["optimizers"]]}))
"""


def test_wheel_install_in_a_fresh_venv(tmp_path):
    """A non-editable install: the wheel's own .pth and policies, nothing from the source tree."""
    dist = tmp_path / "dist"
    build = run_python(["-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, ROOT])
    assert build.returncode == 0, build.stderr
    [wheel] = dist.glob("autopatch-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    fresh = venv / "bin" / "python"
    inst = run_python(["-m", "pip", "--python", fresh, "install", "--no-deps", "--no-index", "-q", wheel])
    assert inst.returncode == 0, inst.stderr
    purelib = Path(run_python(["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              python=fresh).stdout.strip())
    assert (purelib / "autopatch.pth").is_file()
    # torch and the other dependencies come from the outer venv as a plain path entry (no .pth of
    # the outer venv runs, so its editable autopatch stays invisible); "_" sorts before the
    # wheel's autopatch.pth, so the dependencies are on sys.path when it runs.
    (purelib / "_outer_deps.pth").write_text(f"{site_packages()}\n")
    script = write_script(tmp_path / "check.py", WHEEL_CHECK)
    env = clean_env(FUSEDOPT_ENABLE="1")
    del env["PYTHONPATH"]
    res = run_python([script], python=fresh, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["enabled"] is True
    assert Path(out["file"]).is_relative_to(purelib) and Path(out["builtin_dir"]).is_relative_to(purelib)
    assert {"default", "safe", "multi_layer", "backward", "forward", "autotune", "distributed"} <= set(out["names"])
    assert out["safe"] == "off" and out["steps"] == [2]
    assert "autopatch: policy default, 1 optimizer(s)" in res.stderr
    check = run_python(["policy", "check", "backward"], python=venv / "bin" / "autopatch", env=env)
    assert check.returncode == 0 and '"mode": "backward"' in check.stdout, check.stderr
