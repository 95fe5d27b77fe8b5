"""TensorBoard for real: logs from a real autotuned run, read back with TensorBoard's own event
reader, served by a real ``tensorboard`` process, and the autopatch tab loaded in headless Chromium."""

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from spawn import ROOT, clean_env, run_python
from autotune_job import FAST_YAML

pytest.importorskip("bayes_opt")
pytest.importorskip("tensorboard")


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    """A real short autotuned run of the example, zero-code, logging to TensorBoard."""
    tmp = tmp_path_factory.mktemp("tb")
    (tmp / "fast.yaml").write_text(FAST_YAML)
    logs = tmp / "logs"
    out = run_python([ROOT / "examples" / "train_autotune.py", "--steps", "600", "--width", "32",
                      "--depth", "8", "--threads", "1"],
                     env=clean_env(FUSEDOPT_ENABLE=1, FUSEDOPT_POLICY=tmp / "fast.yaml", FUSEDOPT_LOGDIR=logs,
                                   FUSEDOPT_REPORT=tmp / "report.json"))
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp / "report.json").read_text())["autotune"]
    assert report["phase"] == "frozen" and len(report["trials"]) >= 5, report
    return logs, report


AUTO_YAML = "version: 1\nfusion:\n  mode: auto\n  observe_steps: 2\n  measure_steps: 48\n"


@pytest.fixture(scope="module")
def auto_run(logdir, tmp_path_factory):
    """A real run of the example under mode auto (no autotune), logging to the run ``auto``."""
    tmp = tmp_path_factory.mktemp("tb-auto")
    (tmp / "auto.yaml").write_text(AUTO_YAML)
    out = run_python([ROOT / "examples" / "train_mlp.py", "--steps", "120", "--depth", "8"],
                     env=clean_env(FUSEDOPT_ENABLE=1, FUSEDOPT_POLICY=tmp / "auto.yaml",
                                   FUSEDOPT_LOGDIR=logdir[0] / "auto", FUSEDOPT_REPORT=tmp / "report.json"))
    assert out.returncode == 0, out.stderr
    auto = json.loads((tmp / "report.json").read_text())["optimizers"][0]["auto"]
    assert auto["chosen"] in auto["candidates"] and not auto["measuring"], auto
    return auto


def test_scalars_and_hparams_sessions_read_back(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2
    logs, report = logdir
    main = EventAccumulator(str(logs)).Reload()
    tags = set(main.Tags()["scalars"])
    assert {"autopatch/step_time_ms", "autopatch/optimizer_time_ms", "autopatch/forward_time_ms",
            "autopatch/backward_time_ms", "autopatch/data_wait_ms", "autopatch/autopatch_time_ms",
            "autopatch/throughput", "autopatch/trial"} <= tags
    assert "_hparams_/experiment" in main.Tags()["tensors"]
    assert report["unit"] == "samples/s"          # the example's DataLoader gave the batch size

    for trial in report["trials"]:
        run = EventAccumulator(str(logs / f"trial-{trial['trial']:03d}")).Reload()
        start = run.Tensors("_hparams_/session_start_info")[0]
        data = plugin_data_pb2.HParamsPluginData.FromString(
            run.summary_metadata["_hparams_/session_start_info"].plugin_data.content)
        hparams = {k: v.string_value or v.number_value for k, v in data.session_start_info.hparams.items()}
        assert start is not None
        assert hparams == {"mode": trial["config"]["mode"],
                           "chunk_size_2p": float(trial["config"]["chunk_size_2p"])}
        (score,) = run.Scalars("autopatch/score")
        assert score.step == trial["train_iter"]
        assert score.value == pytest.approx(trial["score"], rel=1e-6)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read().decode()


@pytest.fixture(scope="module")
def server(logdir, auto_run, tmp_path_factory):
    logs, report = logdir
    port = free_port()
    log = (tmp_path_factory.mktemp("server") / "tensorboard.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logs),
                             "--host", "127.0.0.1", "--port", str(port)],
                            env=clean_env(), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            if "autopatch" in get(f"{base}/data/plugins_listing")[2]:
                break
        except OSError:
            pass
        assert proc.poll() is None and time.time() < deadline, f"tensorboard did not start, see {log.name}"
        time.sleep(0.5)
    yield base, report, auto_run
    proc.terminate()
    proc.wait(timeout=20)
    log.close()


def test_plugin_routes_serve_the_run(server):
    base, report, auto = server
    listing = json.loads(get(f"{base}/data/plugins_listing")[2])
    assert listing["autopatch"]["enabled"] is True
    assert listing["autopatch"]["loading_mechanism"] == {"type": "IFRAME", "module_path": "/data/plugin/autopatch/index.js"}
    status, ctype, js = get(f"{base}/data/plugin/autopatch/index.js")
    assert status == 200 and "javascript" in ctype and "export async function render" in js
    assert json.loads(get(f"{base}/data/plugin/autopatch/runs")[2])["runs"] == [".", "auto"]
    run = json.loads(get(f"{base}/data/plugin/autopatch/run?run=.")[2])
    assert [t["score"] for t in run["trials"]] == [t["score"] for t in report["trials"]]
    # the table's step time is the one the score stands for: both rank the trials alike
    batch = 32   # the example's DataLoader
    assert all(t["step_ms"] == pytest.approx(1e3 * batch / t["score"], rel=1e-9) for t in run["trials"])
    assert run["frozen"]["config"] == report["best"]["config"]
    assert run["best_trial"] == report["best"]["trial"]
    assert set(run["breakdown"]) >= {t["modes"][0] for t in report["trials"]}
    # where the steps went, window by window, and each trial's breakdown beside its score
    assert run["timeline"] and all({"forward", "backward", "optimizer", "data"} <= set(w["parts_ms"])
                                   for w in run["timeline"])
    assert all("data" in t["breakdown_ms"] for t in run["trials"] if t["score"] is not None)
    assert run["auto"] == []              # autotune chose the mode there: auto did not measure
    [measured] = json.loads(get(f"{base}/data/plugin/autopatch/run?run=auto")[2])["auto"]
    assert measured["chosen"] == auto["chosen"] and measured["ms_per_step"] == auto["ms_per_step"]
    assert measured["measure_steps"] == auto["measure_steps"] <= 48
    assert measured["ran"] == auto["ran"] and measured["dropped"] == auto["dropped"]
    with pytest.raises(urllib.error.HTTPError):
        get(f"{base}/data/plugin/autopatch/run?run=../..")


def test_empty_and_partial_log_dirs_get_a_clear_message(tmp_path):
    from tensorboard.plugins.base_plugin import TBContext
    from werkzeug.test import Client
    from autopatch_tensorboard.plugin import AutopatchPlugin

    def route(logdir, path):
        apps = AutopatchPlugin(TBContext(logdir=str(logdir))).get_plugin_apps()
        return json.loads(Client(apps[path.split("?")[0]]).get(path).get_data())

    empty = tmp_path / "empty"
    empty.mkdir()
    body = route(empty, "/runs")
    assert body["runs"] == [] and "No autopatch records" in body["message"]

    partial = tmp_path / "partial" / "job"
    partial.mkdir(parents=True)
    trial = {"kind": "trial", "trial": 0, "config": {"mode": "off"}, "score": 10.0, "train_iter": 20}
    (partial / "autopatch.jsonl").write_text(json.dumps(trial) + '\n{"kind": "tri')
    body = route(partial.parent, "/run?run=job")
    assert body["partial"] and body["frozen"] is None and len(body["trials"]) == 1
    assert "Search in progress: 1 trial(s)" in body["message"] and "half-written" in body["message"]


def test_a_failed_trial_is_listed_as_failed_and_never_best(tmp_path):
    from tensorboard.plugins.base_plugin import TBContext
    from werkzeug.test import Client
    from autopatch_tensorboard.plugin import AutopatchPlugin
    trials = [{"kind": "trial", "trial": 0, "config": {"mode": "off"}, "score": 10.0, "train_iter": 20},
              {"kind": "trial", "trial": 1, "config": {"mode": "backward"}, "score": None, "train_iter": 31,
               "failed": "backward became unsafe: a parameter received a second gradient"}]
    (tmp_path / "autopatch.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trials))
    app = AutopatchPlugin(TBContext(logdir=str(tmp_path))).get_plugin_apps()["/run"]
    body = json.loads(Client(app).get("/run?run=.").get_data())
    assert body["best_trial"] == 0
    assert body["trials"][1]["score"] is None and "became unsafe" in body["trials"][1]["failed"]


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.skipif(chromium() is None or shutil.which("chromedriver") is None,
                    reason="headless browser test needs Debian's chromium and chromium-driver "
                           "(apt-get install -y chromium chromium-driver)")
def test_dashboard_tab_in_headless_chromium(server, tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import Select, WebDriverWait
    base, report, auto = server
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1300,1000"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    try:
        driver.get(f"{base}/#autopatch")
        wait = WebDriverWait(driver, 60)
        driver.switch_to.frame(wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "iframe"))))
        wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "#trials tbody tr")))
        rows = driver.find_elements(By.CSS_SELECTOR, "#trials tbody tr")
        assert len(rows) == len(report["trials"])
        best = report["best"]["config"]
        frozen = driver.find_element(By.ID, "frozen").text
        assert f"Frozen config: mode={best['mode']}, chunk_size_2p={best['chunk_size_2p']}" in frozen
        best_row = driver.find_element(By.CSS_SELECTOR, "#trials tr.best").text.split()
        assert best_row[0] == str(report["best"]["trial"])
        driver.find_element(By.CSS_SELECTOR, "th[data-col='score']").click()   # sort: best first
        first = driver.find_element(By.CSS_SELECTOR, "#trials tbody tr").text.split()
        assert first[0] == str(report["best"]["trial"])
        by_score = [r.text.split()[0] for r in driver.find_elements(By.CSS_SELECTOR, "#trials tbody tr")]
        driver.find_element(By.CSS_SELECTOR, "th[data-col='step ms']").click()  # fastest first
        by_time = [r.text.split()[0] for r in driver.find_elements(By.CSS_SELECTOR, "#trials tbody tr")]
        assert by_time == by_score
        assert "so that load from other jobs cancels out" in driver.find_element(By.ID, "trials-note").text
        assert driver.find_elements(By.CSS_SELECTOR, "#breakdown rect")
        assert driver.find_elements(By.CSS_SELECTOR, "#timeline rect")
        assert "fwd " in driver.find_element(By.CSS_SELECTOR, "#trials tbody tr").text
        Select(driver.find_element(By.ID, "run-select")).select_by_value("auto")
        wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "#auto table tbody tr")))
        modes = [r.text.split()[0] for r in driver.find_elements(By.CSS_SELECTOR, "#auto tbody tr")]
        assert modes == auto["candidates"]
        chosen = driver.find_element(By.CSS_SELECTOR, "#auto tr.chosen").text.split()
        assert chosen[0] == auto["chosen"] and f"chose {auto['chosen']}" in driver.find_element(By.ID, "auto").text
        ran = [int(c.text) for c in driver.find_elements(By.CSS_SELECTOR, "#auto tbody td.ran")]
        assert ran == [auto["ran"][m] for m in auto["candidates"]]       # the steps each mode ran
        left = [c.text for c in driver.find_elements(By.CSS_SELECTOR, "#auto tbody td.left")]
        assert all(f"step {auto['dropped'][m]['step']}" in t for m, t in zip(auto["candidates"], left)
                   if m in auto["dropped"])
        driver.switch_to.default_content()
        driver.save_screenshot(str(tmp_path / "autopatch-dashboard.png"))
        assert (tmp_path / "autopatch-dashboard.png").stat().st_size > 10_000
    finally:
        driver.quit()


def test_the_wheel_ships_the_plugin_and_registers_it(tmp_path):
    import zipfile
    out = run_python(["-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path, ROOT])
    assert out.returncode == 0, out.stderr
    [wheel] = tmp_path.glob("autopatch-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert {"autopatch_tensorboard/plugin.py", "autopatch_tensorboard/static/index.js"} <= names
    assert "[tensorboard_plugins]\nautopatch = autopatch_tensorboard.plugin:AutopatchPlugin" in entry_points
