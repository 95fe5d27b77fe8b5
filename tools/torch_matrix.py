#!/usr/bin/env python3
"""Run autopatch's quick start and test suite against several torch releases.

pyproject.toml declares a torch floor, but day-to-day work happens on one release; this script
shows what the others do. For each version it builds (or reuses) a virtual environment with that
torch pinned for the whole install, installs this repository editable with its test extras, then
runs four legs and writes a table per version (markdown and JSON):

  install     torch==X first, then '<repo>[dev,autotune,tensorboard,integrations]' with torch
              still pinned, so pip either finds extras compatible with X or fails clearly (then
              the core package alone and pytest are installed, and the table says so)
  quickstart  examples/train_mlp.py unpatched and with FUSEDOPT_ENABLE=1: the printed losses and
              accuracy must be identical
  tests       pytest over all tests, the quick subset, or the pytest arguments given
  apis        tools/torch_api_probe.py: which torch private APIs autopatch relies on exist here

Usage:
  python tools/torch_matrix.py                            # default versions, quick tests
  python tools/torch_matrix.py -v 2.11.0 2.15.0 --tests all
  python tools/torch_matrix.py -v 2.13.0 --tests "tests/test_fsdp.py -k dtensor"

A version with two components (2.4) installs the newest patch release (torch==2.4.*). Venvs that
already hold the asked torch and an install of this repository are reused (--rebuild makes them
anew). Everything it starts runs in its own process group, which is killed on a timeout, on an
error and on Ctrl-C, so nothing is left running.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXTRAS = "dev,autotune,tensorboard,integrations"
RELEASES = ["2.11.0", "2.13.0", "2.14.1", "2.15.0"]
QUICK_TESTS = ["tests/modes/test_fusion_modes.py", "tests/modes/test_interception.py",
               "tests/modes/test_grad_semantics.py", "tests/modes/test_watch.py",
               "tests/fusion/test_multi_layer.py", "tests/fusion/test_routes.py",
               "tests/fusion/test_unflattenable.py", "tests/fusion/test_local_shards.py",
               "tests/comm/test_allreduce.py", "tests/comm/test_algorithms.py", "tests/conformance"]
MARKER = "torch_matrix.json"          # written into a venv once its install finished
LOSS_LINE = re.compile(r"^step\s+\d+\s+loss\s+\S+$")
ACCURACY = re.compile(r"(\d+) tensors \((\d+) weights\).*test accuracy ([\d.]+)%")


def log(msg):
    """Progress on stderr, timestamped: installs and test runs take minutes."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def declared_floor():
    """The torch floor pyproject.toml declares (``torch>=2.4`` gives ``2.4``)."""
    text = (REPO / "pyproject.toml").read_text()
    found = re.search(r'"torch\s*>=\s*([\d.]+)', text)
    return found.group(1) if found else None


def pip_spec(version):
    """``2.4`` means the newest 2.4 patch release; a full version is taken exactly."""
    return f"torch=={version}.*" if version.count(".") == 1 else f"torch=={version}"


def version_matches(version, installed):
    """True when the installed torch (``2.13.0+cpu``) is the asked one (``2.13.0`` or ``2.13``)."""
    base = installed.split("+")[0]
    return base == version or (version.count(".") == 1 and base.startswith(version + "."))


# -- running commands ------------------------------------------------------------------------------

def run(cmd, *, log_path, timeout, env=None, cwd=REPO, nice=True):
    """Run ``cmd`` in its own process group with output to ``log_path``; kill the whole group on
    a timeout, on an exception or Ctrl-C, and after it exits (workers it left behind).
    Returns (exit code or None on timeout, seconds)."""
    cmd = [str(c) for c in cmd]
    if nice and shutil.which("nice"):
        cmd = ["nice", "-n", "10", *cmd]
    start = time.monotonic()
    with open(log_path, "a") as out:
        out.write(f"$ {shlex.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            out.write(f"\n!!! timed out after {timeout} s: killed\n")
            code = None
        finally:
            kill_group(proc)
    return code, round(time.monotonic() - start, 1)


def kill_group(proc):
    """SIGTERM then SIGKILL the process group ``proc`` leads, whether or not it already exited."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if sig == signal.SIGTERM:
            time.sleep(0.5)        # children may outlive the leader: the SIGKILL catches them


def capture(python, code, timeout=120):
    """stdout of ``python -c code``, or None when it fails."""
    try:
        done = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                              timeout=timeout, cwd=tempfile.gettempdir())
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


# -- the install leg -------------------------------------------------------------------------------

def venv_state(venv, version, want_extras=True):
    """Why ``venv`` cannot be reused as it is, or None when it is healthy: the asked torch
    imports and the marker says this repository (with its extras, when wanted) was installed."""
    python = venv / "bin" / "python"
    if not python.exists():
        return "no venv"
    installed = capture(python, "import torch; print(torch.__version__)")
    if installed is None:
        return "torch does not import"
    if not version_matches(version, installed):
        return f"holds torch {installed}"
    marker = venv / MARKER
    if not marker.exists():
        return "install not finished"
    recorded = json.loads(marker.read_text())
    if recorded.get("repo") != str(REPO):
        return f"autopatch installed from {recorded.get('repo')}"
    if want_extras and not recorded.get("extras"):
        return "installed without the extras"
    if capture(python, "import autopatch") is None:
        return "autopatch does not import"
    return None


def pip(venv, args, constraint, log_path, timeout):
    """pip in ``venv`` with ``constraint`` as the only constraint file (it replaces the
    machine-wide cap, so a torch above it can install, and pins torch for every dependency)."""
    env = dict(os.environ, PIP_CONSTRAINT=str(constraint), PIP_DISABLE_PIP_VERSION_CHECK="1")
    return run([venv / "bin" / "python", "-m", "pip", "install", *args], log_path=log_path,
               timeout=timeout, env=env)


def pip_conflict(log_path):
    """The lines of a pip log that say why it failed (resolution conflicts, errors)."""
    keep = []
    for line in Path(log_path).read_text(errors="replace").splitlines():
        s = line.strip()
        if s.startswith(("ERROR", "The conflict is caused by", "    ")) or " depends on " in s \
                or "requires" in s and "torch" in s:
            keep.append(s)
    return [k for k in dict.fromkeys(keep) if k][:12]


def install(version, venv, outdir, args):
    """Build or reuse the venv for ``version``. Returns the install part of the results."""
    result = {"venv": str(venv), "legs": {}}
    reason = "rebuild asked" if args.rebuild else venv_state(venv, version, not args.core_only)
    if reason is None:
        log(f"torch {version}: reusing healthy venv {venv}")
        marker = json.loads((venv / MARKER).read_text())
        result.update(status="reused", extras=marker.get("extras", True), built=marker.get("legs", {}))
        return result
    log(f"torch {version}: installing into {venv} ({reason})")
    log_path = outdir / f"install-{version}.log"
    log_path.write_text("")
    if args.rebuild and venv.exists():
        shutil.rmtree(venv)
    (venv / MARKER).unlink(missing_ok=True)
    if not (venv / "bin" / "python").exists():
        code, secs = run([args.python, "-m", "venv", venv], log_path=log_path, timeout=300)
        result["legs"]["venv"] = secs
        if code != 0:
            return dict(result, status="failed", error="python -m venv failed")
    constraint = venv / "torch-pin.txt"
    constraint.write_text(pip_spec(version) + "\n")
    log(f"torch {version}: pip install {pip_spec(version)} (a CUDA build is several GB: minutes)")
    code, secs = pip(venv, [pip_spec(version)], constraint, log_path, args.install_timeout)
    result["legs"]["install_torch"] = secs
    if code != 0:
        return dict(result, status="failed", error="torch did not install: " + describe_exit(code),
                    pip=pip_conflict(log_path))
    code = None
    if not args.core_only:
        log(f"torch {version}: pip install -e '.[{EXTRAS}]' with torch pinned")
        code, secs = pip(venv, ["-e", f"{REPO}[{EXTRAS}]"], constraint, log_path, args.install_timeout)
        result["legs"]["install_extras"] = secs
    result["extras"] = code == 0
    if code != 0:
        if not args.core_only:
            result["extras_error"] = pip_conflict(log_path)
            log(f"torch {version}: the extras do not install beside it")
        log(f"torch {version}: installing the core package and pytest")
        code, secs = pip(venv, ["-e", str(REPO), "pytest"], constraint, log_path, args.install_timeout)
        result["legs"]["install_core"] = secs
        if code != 0:
            return dict(result, status="failed", error="the core package did not install: " + describe_exit(code),
                        pip=pip_conflict(log_path))
    installed = capture(venv / "bin" / "python", "import torch; print(torch.__version__)")
    if installed is None or not version_matches(version, installed):
        return dict(result, status="failed", error=f"torch {installed} imports, not {version}")
    (venv / MARKER).write_text(json.dumps({"repo": str(REPO), "torch": installed, "extras": result["extras"],
                                           "legs": result["legs"]}))
    return dict(result, status="installed" if result["extras"] else "core only")


def describe_exit(code):
    return "timed out" if code is None else f"exit {code}"


# -- the quick start leg ---------------------------------------------------------------------------

def train_env(enable, threads):
    """This environment with autopatch on or off and no other FUSEDOPT_* setting in effect."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSEDOPT_")}
    env.update(FUSEDOPT_ENABLE="1" if enable else "0", OMP_NUM_THREADS=str(threads),
               PYTHONUNBUFFERED="1")
    return env


def training_lines(log_path):
    """What must not change between patched and unpatched: the loss lines and the final
    tensor count and accuracy (not the seconds)."""
    lines = []
    for line in Path(log_path).read_text(errors="replace").splitlines():
        if LOSS_LINE.match(line.strip()):
            lines.append(line.strip())
        elif m := ACCURACY.search(line):
            lines.append(f"{m.group(1)} tensors ({m.group(2)} weights), accuracy {m.group(3)}%")
    return lines


def quickstart(version, python, outdir, args):
    """Train examples/train_mlp.py unpatched and patched; identical lines or not."""
    result, lines = {"legs": {}}, {}
    for name, enable in (("unpatched", False), ("patched", True)):
        log(f"torch {version}: quick start {name} (FUSEDOPT_ENABLE={int(enable)})")
        log_path = outdir / f"quickstart-{name}-{version}.log"
        log_path.write_text("")
        code, secs = run([python, "examples/train_mlp.py"], log_path=log_path,
                         timeout=args.quickstart_timeout, env=train_env(enable, args.threads))
        result["legs"][f"quickstart_{name}"] = secs
        result[f"{name}_exit"] = describe_exit(code)
        lines[name] = training_lines(log_path)
        if code != 0:
            result.setdefault("errors", []).append(f"{name}: {describe_exit(code)}; "
                                                   f"{last_error(log_path)}")
    complete = all(lines[n] and any("accuracy" in x for x in lines[n]) for n in lines)
    result["identical"] = complete and lines["unpatched"] == lines["patched"]
    if complete:
        result["accuracy"] = lines["unpatched"][-1]
    if complete and not result["identical"]:
        result["first_difference"] = next(
            (f"{a!r} vs {b!r}" for a, b in zip(lines["unpatched"], lines["patched"]) if a != b), "line count")
    result["autopatch_summary"] = summary_lines(outdir / f"quickstart-patched-{version}.log")
    return result


def last_error(log_path):
    """The last line of a traceback (the exception), or the last line of the output."""
    text = [line for line in Path(log_path).read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in text if re.match(r"^\w+(\.\w+)*(Error|Exception|Warning)\b", line)]
    return (errors or text or ["no output"])[-1][:300]


def summary_lines(log_path):
    """autopatch's exit summary (which mode auto chose), and any warning it printed."""
    keep = []
    for line in Path(log_path).read_text(errors="replace").splitlines():
        if line.startswith("autopatch") or "auto chose" in line or "Warning" in line:
            keep.append(line.strip()[:400])
    return keep[:8]


# -- the test leg ----------------------------------------------------------------------------------

def test_args(selection):
    """pytest arguments for ``all``, ``quick`` or pytest arguments as given."""
    if selection == "all":
        return ["tests"]
    if selection == "quick":
        missing = [path for path in QUICK_TESTS if not (REPO / path).exists()]
        if missing:
            raise SystemExit(f"the quick test list names files that moved: {', '.join(missing)}")
        return QUICK_TESTS
    return shlex.split(selection)


def run_tests(version, python, outdir, args):
    """pytest with per-test outcomes from its JUnit XML, or from its -v lines if it was killed."""
    log_path, junit = outdir / f"tests-{version}.log", outdir / f"junit-{version}.xml"
    log_path.write_text("")
    junit.unlink(missing_ok=True)
    log(f"torch {version}: pytest {args.tests} (log: {log_path})")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env = {k: v for k, v in env.items() if not k.startswith("FUSEDOPT_")}
    code, secs = run([python, "-m", "pytest", "-v", "-rA", "-p", "no:cacheprovider", f"--junitxml={junit}",
                      *test_args(args.tests)], log_path=log_path, timeout=args.test_timeout, env=env)
    outcomes = junit_outcomes(junit) if junit.exists() else verbose_outcomes(log_path)
    counts = {k: sum(1 for v in outcomes.values() if v["outcome"] == k)
              for k in ("passed", "failed", "error", "skipped")}
    failures = {name: v["message"] for name, v in outcomes.items() if v["outcome"] in ("failed", "error")}
    log(f"torch {version}: tests {counts} in {secs} s")
    result = {"legs": {"tests": secs}, "exit": describe_exit(code), "counts": counts, "failures": failures,
              "complete": junit.exists()}
    if failures and args.rerun_failures:
        result["alone"], result["legs"]["reruns"] = rerun_alone(version, python, outdir, failures, args, env)
    return result


def rerun_alone(version, python, outdir, failures, args, env):
    """Run each failed test by itself: one that passes alone failed from load or from its
    neighbours, not from this torch. Returns ({test id: passed|failed|timed out}, seconds)."""
    alone, total = {}, 0.0
    log_path = outdir / f"reruns-{version}.log"
    log_path.write_text("")
    for name in list(failures)[:args.rerun_failures]:
        log(f"torch {version}: rerunning alone {name}")
        code, secs = run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", name], log_path=log_path,
                         timeout=args.quickstart_timeout, env=env)
        alone[name] = {0: "passed", None: "timed out"}.get(code, "failed")
        total += secs
    return alone, round(total, 1)


def junit_outcomes(path):
    """{test id: {outcome, message}} from pytest's JUnit XML."""
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = "failed" if tag == "failure" else tag
                message = el.get("message") or (el.text or "")
                break
        outcomes[test_id(case.get("classname", ""), case.get("name"))] = {"outcome": outcome,
                                                                          "message": one_line(message)}
    return outcomes


def test_id(classname, name):
    """pytest's node id (tests/test_x.py::TestY::test_z) from JUnit's dotted class name, so a
    failure can be rerun as written."""
    parts = classname.split(".")
    cut = next((i for i, part in enumerate(parts) if part.startswith("test_")), len(parts) - 1)
    return "::".join(["/".join(parts[:cut + 1]) + ".py", *parts[cut + 1:], name])


def one_line(message):
    """A multi-line assertion message as one table-friendly line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return " | ".join(lines)[:400]


def verbose_outcomes(log_path):
    """{test id: {outcome, message}} from ``pytest -v`` lines, for a run killed before its XML."""
    outcomes = {}
    pattern = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")
    for line in Path(log_path).read_text(errors="replace").splitlines():
        if m := pattern.match(line):
            word = m.group(2).lower()
            outcome = {"xfail": "skipped", "xpass": "passed"}.get(word, word)
            outcomes[m.group(1)] = {"outcome": outcome, "message": ""}
    return outcomes


# -- the private-API leg ---------------------------------------------------------------------------

def probe_apis(version, python, outdir, args):
    """tools/torch_api_probe.py in the venv: which private torch APIs are missing or differ."""
    log(f"torch {version}: probing the private torch APIs autopatch uses")
    log_path, out = outdir / f"apis-{version}.log", outdir / f"apis-{version}.json"
    log_path.write_text("")
    out.unlink(missing_ok=True)
    code, secs = run([python, REPO / "tools" / "torch_api_probe.py", out], log_path=log_path, timeout=300)
    if code != 0 or not out.exists():
        return {"legs": {"apis": secs}, "error": f"probe {describe_exit(code)}; {last_error(log_path)}"}
    checks = json.loads(out.read_text())
    return {"legs": {"apis": secs}, "checks": checks,
            "differ": [c["name"] for c in checks if not c["ok"]]}


# -- one version, and the tables -------------------------------------------------------------------

def one_version(version, args):
    """Every leg for ``version``; a failed install skips the rest."""
    outdir, venv = Path(args.out), Path(args.venv_root) / f"torch-{version}"
    started = time.monotonic()
    result = {"version": version, "install": install(version, venv, outdir, args)}
    python = venv / "bin" / "python"
    if result["install"]["status"] != "failed":
        result["torch"] = capture(python, "import torch; print(torch.__version__)")
        if "quickstart" in args.legs:
            result["quickstart"] = quickstart(version, python, outdir, args)
        if "tests" in args.legs:
            result["tests"] = run_tests(version, python, outdir, args)
        if "apis" in args.legs:
            result["apis"] = probe_apis(version, python, outdir, args)
    result["seconds"] = round(time.monotonic() - started, 1)
    result["finished"] = time.strftime("%Y-%m-%d %H:%M")
    carry_over(result, outdir / f"results-{version}.json", args.legs)
    (outdir / f"results-{version}.json").write_text(json.dumps(result, indent=1))
    return result


def carry_over(result, path, legs):
    """Keep the previous run's result of each leg not run this time (same torch build), so that
    rerunning one leg, or resuming, still gives the whole table."""
    if not path.exists():
        return
    previous = json.loads(path.read_text())
    if previous.get("torch") != result.get("torch"):
        return
    for leg in ("quickstart", "tests", "apis"):
        if leg not in legs and leg in previous:
            ran = previous[leg].get("carried_over") or previous.get("finished")
            result[leg] = dict(previous[leg], carried_over=ran)


def legs_cell(result):
    """Each leg's wall time; a reused venv's install legs are those of its build."""
    built = {f"{k} (at build)": v for k, v in result["install"].get("built", {}).items()}
    legs = dict(built)
    for part in ("install", "quickstart", "tests", "apis"):
        legs.update(result.get(part, {}).get("legs", {}))
    return ", ".join(f"{k} {v:.0f}s" for k, v in legs.items())


def markdown(results, selection):
    """One row per version, then each version's failures and differing APIs."""
    rows = ["| torch | install | quick start identical | passed | failed | errors | skipped | legs (wall time) |",
            "|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in results:
        inst, qs, tests = r["install"], r.get("quickstart", {}), r.get("tests", {})
        c = tests.get("counts", {})
        identical = {True: "yes", False: "**no**"}.get(qs.get("identical"), "-")
        suffix = "" if tests.get("complete", True) else " (killed)"
        rows.append(f"| {r.get('torch') or r['version']} | {inst['status']} | {identical} | {c.get('passed', '-')} "
                    f"| {c.get('failed', '-')}{suffix} | {c.get('error', '-')} | {c.get('skipped', '-')} "
                    f"| {legs_cell(r)} |")
        notes += version_notes(r)
    head = f"torch matrix, tests: `{selection}`, {time.strftime('%Y-%m-%d %H:%M')}\n\n"
    return head + "\n".join(rows) + "\n" + ("\n" + "\n".join(notes) + "\n" if notes else "")


def version_notes(r):
    """Markdown lines on what went wrong for one version."""
    out, inst = [], r["install"]
    if inst.get("error"):
        out.append(f"- install: {inst['error']}")
    for line in inst.get("pip", []) + inst.get("extras_error", []):
        out.append(f"  - pip: `{line}`")
    for e in r.get("quickstart", {}).get("errors", []):
        out.append(f"- quick start {e}")
    if r.get("quickstart", {}).get("first_difference"):
        out.append(f"- quick start differs: {r['quickstart']['first_difference']}")
    alone = r.get("tests", {}).get("alone", {})
    for name, msg in r.get("tests", {}).get("failures", {}).items():
        rerun = f" (alone: {alone[name]})" if name in alone else ""
        out.append(f"- `{name}`{rerun}: {msg}")
    earlier = sorted({f"{leg} ({r[leg]['carried_over'] or 'earlier'})" for leg in ("quickstart", "tests", "apis")
                      if r.get(leg, {}).get("carried_over", False) is not False})
    if earlier:
        out.append(f"- from an earlier run: {', '.join(earlier)}")
    if r.get("apis", {}).get("error"):
        out.append(f"- API probe: {r['apis']['error']}")
    for c in r.get("apis", {}).get("checks", []):
        if not c["ok"]:
            out.append(f"- API `{c['name']}` ({c['where']}): {c['detail']}")
    return [f"### torch {r.get('torch') or r['version']}"] + out if out else []


def parse_args(argv):
    floor = declared_floor()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("-v", "--versions", nargs="+", default=([floor] if floor else []) + RELEASES,
                    help=f"torch versions (default: the declared floor {floor}, then {' '.join(RELEASES)})")
    ap.add_argument("--venv-root", default="/work/venvs", help="venvs go to VENV_ROOT/torch-X (default %(default)s)")
    ap.add_argument("--out", default=str(REPO / "runs" / "torch-matrix"),
                    help="logs and results-*.json, results.md, results.json (default %(default)s)")
    ap.add_argument("--tests", default="quick",
                    help="all, quick (the files in QUICK_TESTS: fusion modes, interception, grad semantics, the watch, multi_layer, routes, unflattenable, "
                         "local shards, allreduce, algorithms, the conformance suite) or pytest arguments as one string")
    ap.add_argument("--legs", default="quickstart,tests,apis",
                    help="comma-separated subset of quickstart,tests,apis (the install always runs)")
    ap.add_argument("--rerun-failures", type=int, default=10, metavar="N",
                    help="rerun up to N failed tests one by one, to tell load from torch (0: never)")
    ap.add_argument("--rebuild", action="store_true", help="delete and rebuild each venv")
    ap.add_argument("--core-only", action="store_true",
                    help="install the package without its extras (and pytest): does the core work on X?")
    ap.add_argument("--python", default=sys.executable, help="the interpreter venvs are made from")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for the quick start")
    ap.add_argument("--install-timeout", type=int, default=1800, help="seconds per pip command")
    ap.add_argument("--quickstart-timeout", type=int, default=600, help="seconds per quick-start run")
    ap.add_argument("--test-timeout", type=int, default=5400, help="seconds for the whole pytest run")
    args = ap.parse_args(argv)
    args.legs = {leg.strip() for leg in args.legs.split(",") if leg.strip()}
    return args


def main(argv=None):
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    log(f"torch matrix: versions {' '.join(args.versions)}; venvs under {args.venv_root}; results in {args.out}")
    results = []
    for version in args.versions:
        results.append(one_version(version, args))
        text = markdown(results, args.tests)
        (Path(args.out) / "results.md").write_text(text)
        (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
    print(text)
    bad = [r["version"] for r in results if r["install"]["status"] == "failed"
           or r.get("quickstart", {}).get("identical") is False
           or any(r.get("tests", {}).get("counts", {}).get(k) for k in ("failed", "error"))
           or r.get("tests", {}).get("complete") is False]
    log(f"done: {len(results) - len(bad)} of {len(results)} versions clean" + (f"; not: {' '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
