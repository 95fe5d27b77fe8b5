"""Autotune: a short search on CPU explores trials, freezes the best and never changes training."""

import csv
import json
import os
import re
import shutil
import socket
from pathlib import Path

import pytest
import torch

from spawn import clean_env, patience, run_python, write_script
from autotune_job import FAST, FAST_YAML, job
from training import assert_same, batches, mlp, train, weights

pytest.importorskip("bayes_opt")

def test_search_explores_freezes_best_and_trains_like_unpatched(ap, tmp_path):
    ap.enable("autotune", autotune={**FAST, "log_csv": str(tmp_path / "trials.csv"),
                                    "save_best": str(tmp_path / "best.json")})
    model, losses = job(until_frozen=ap)
    rep = ap.report()
    ap.disable()
    ref_model, ref_losses = job(len(losses))
    tune = rep["autotune"]
    assert tune["phase"] == "frozen", tune
    assert len(tune["trials"]) >= 5
    assert tune["best"]["score"] == max(t["score"] for t in tune["trials"])
    assert tune["applied"][-1][1] == tune["best"]["config"]
    assert rep["optimizers"][0]["mode"] == tune["best"]["config"]["mode"], rep["optimizers"]
    assert tune["cost"]["search_seconds"] > 0
    assert_same(losses, ref_losses)
    assert_same(weights(model), weights(ref_model))

    rows = list(csv.reader((tmp_path / "trials.csv").open()))
    assert rows[0] == ["mode", "chunk_size_2p", "score", "train_iter"]
    assert [(r[0], float(r[2]), int(r[3])) for r in rows[1:]] == \
        [(t["config"]["mode"], t["score"], t["train_iter"]) for t in tune["trials"]]
    saved = json.loads((tmp_path / "best.json").read_text())
    assert saved["config"] == tune["best"]["config"] and saved["score"] == tune["best"]["score"]


def test_resume_applies_the_saved_best_without_searching(ap, tmp_path):
    best = tmp_path / "best.json"
    ap.enable("autotune", autotune={**FAST, "resume": str(best)})   # not there yet: search, save there
    job(until_frozen=ap)
    first = ap.report()["autotune"]
    assert first["trials"] and first["best_json"] == str(best)
    ap.disable()

    ref_model, _ = job(50)
    ap.enable("autotune", autotune={**FAST, "resume": str(best)})
    model, _ = job(50)
    again = ap.report()["autotune"]
    assert again["phase"] == "frozen" and "trials" not in again
    assert again["resumed_from"] == str(best)
    [(at, config)] = again["applied"]      # once, as soon as warm-up (and mode auto) is over
    assert config == first["best"]["config"] and FAST["warmup_steps"] <= at < 20
    assert_same(weights(model), weights(ref_model))


def test_bounds_errors_name_the_file_line_and_key(tmp_path):
    from autopatch import PolicyError, policy
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nautotune:\n  enabled: true\n  bounds:\n    chunk_size_2p: [20, 10]\n")
    with pytest.raises(PolicyError, match=r"bad\.yaml:4: key 'autotune\.bounds': chunk_size_2p: lo 20 is above hi 10"):
        policy.load(str(bad))
    ok = policy.load("autotune", overrides={"autotune.bounds": {"mode": [False, "multi_layer"]}})
    assert ok.autotune.bounds_of("mode") == ("off", "multi_layer")


JOB = """
import autopatch, torch
from training import batches, mlp, train
torch.set_num_threads(1)
model = mlp(width=32, depth=8)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for i, batch in enumerate(batches(5000, width=32, batch=16)):
    train(model, opt, [batch])
    if i % 10 == 0 and autopatch.report()["autotune"]["phase"] == "frozen":
        break
"""


def test_bagua_flags_give_the_csv_the_policy_keys_give(ap, tmp_path, child_tmpdir):
    policy_file = tmp_path / "fast.yaml"
    policy_file.write_text(FAST_YAML)
    script = write_script(tmp_path / "job.py", JOB)
    temp = child_tmpdir
    out = run_python(["-m", "autopatch", "run", "--policy", policy_file, "--autotune_level", "1",
                      "--autotune_max_samples", "5", "--autotune_sampling_confidence_time", "0.02",
                      "--autotune_warmup_time", "0", "--is_output_autotune_log", script],
                     env=clean_env(TMPDIR=temp))
    assert out.returncode == 0, out.stderr
    path = Path(re.search(r"autopatch: autotune log: (\S+)", out.stderr).group(1))
    # where Bagua wrote it, the temp dir, but in this user's private directory there
    assert path.parent == temp / f"autopatch-{os.getuid()}" and path.parent.stat().st_mode & 0o777 == 0o700
    assert path.name.startswith("autopatch_autotune_") and path.suffix == ".log"
    assert path.stat().st_mode & 0o777 == 0o600
    flag_rows = list(csv.reader(path.open()))

    ap.enable(str(policy_file), autotune={"max_samples": 5, "trial_seconds": 0.02, "warmup_seconds": 0.0,
                                          "log_csv": str(tmp_path / "keys.csv")})
    job(until_frozen=ap)
    key_rows = list(csv.reader((tmp_path / "keys.csv").open()))
    assert flag_rows[0] == key_rows[0] == ["mode", "chunk_size_2p", "score", "train_iter"]
    assert len(flag_rows) == len(key_rows) == 6


DDP_JOB = """
import json, sys
import torch, torch.distributed as dist
import autopatch
from training import batches, digest, mlp
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()


def train(steps):
    model = torch.nn.parallel.DistributedDataParallel(mlp(width=32, depth=8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for i, (x, y) in enumerate(batches(steps, width=32, batch=16, seed=1 + rank)):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        # every rank sees the freeze at the same step: all stop together
        if autopatch.is_enabled() and i % 10 == 0 and autopatch.report()["autotune"]["phase"] == "frozen":
            return i + 1, digest(model.module)
    return steps, digest(model.module)


autopatch.enable("autotune", fusion={"mode": "multi_layer"}, autotune=json.loads(sys.argv[2]))
steps, patched = train(5000)
rep = autopatch.report()["autotune"]
autopatch.disable()
_, unpatched = train(steps)
json.dump({"applied": rep["applied"], "trials": len(rep.get("trials", [])), "phase": rep["phase"],
           "digest": patched, "unpatched": unpatched}, open(f"{sys.argv[1]}/rank{rank}.json", "w"))
dist.destroy_process_group()
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_distributed_ranks_apply_identical_configs_at_identical_steps(tmp_path):
    import subprocess
    import sys
    script = write_script(tmp_path / "ddp_job.py", DDP_JOB)
    port = free_port()
    # fusion.mode multi_layer: what is tested here is the agreement, whatever auto would choose.
    tune = {**FAST, "knobs": ["mode", "chunk_size_2p", "bucket_size_2p"],
            "bounds": {**FAST["bounds"], "mode": ["off", "multi_layer"], "bucket_size_2p": [12, 20]}}
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path), json.dumps(tune)],
                              env=clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=r, WORLD_SIZE=2),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=patience(120))
        assert p.returncode == 0, err
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["phase"] == r1["phase"] == "frozen"
    assert r0["trials"] >= 5 and r1["trials"] == 0      # rank 0 decides, rank 1 follows
    assert r0["applied"] == r1["applied"] and len(r0["applied"]) == r0["trials"] + 1
    assert {tuple(config) for _, config in r0["applied"]} == {("mode", "chunk_size_2p", "bucket_size_2p")}
    assert r0["digest"] == r1["digest"] == r0["unpatched"] == r1["unpatched"]


def accumulate(model, opt, batch, parts=2):
    """One step over ``parts`` micro-batches, gradients accumulated before step()."""
    x, y = batch
    opt.zero_grad()
    for xs, ys in zip(x.chunk(parts), y.chunk(parts)):
        (torch.nn.functional.cross_entropy(model(xs), ys) / parts).backward()
    opt.step()


def test_accumulation_starting_mid_trial_fails_that_trial_not_the_run(ap, tmp_path, capsys):
    """The search's second trial runs backward; gradient accumulation starts under it. Nothing
    reaches the loop: the trial is logged as failed and the search goes on without backward."""
    # Two configs: the starting one (mode off once the watch is over) and backward.
    ap.enable("autotune", autotune={**FAST, "bounds": {"mode": ["off", "backward"], "chunk_size_2p": [12, 12]},
                                    "log_csv": str(tmp_path / "trials.csv")})
    torch.manual_seed(0)
    model = mlp(width=32, depth=8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = batches(3000, width=32, batch=16)
    accumulating, frozen_at = None, None
    for i, batch in enumerate(data):
        if accumulating is None and i > 0 and ap.report()["optimizers"][0]["mode"] == "backward":
            accumulating = i
        if accumulating is None:
            train(model, opt, [batch])
        else:
            accumulate(model, opt, batch)
        if accumulating is not None and frozen_at is None and ap.report()["autotune"]["phase"] == "frozen":
            frozen_at = i
        if frozen_at is not None and i == frozen_at + 10:
            break
    rep = ap.report()
    tune, entry = rep["autotune"], rep["optimizers"][0]
    assert accumulating is not None and frozen_at is not None, tune
    failed = [t for t in tune["trials"] if "failed" in t]
    assert [t["config"]["mode"] for t in failed] == ["backward"] and failed[0]["score"] is None
    assert "backward became unsafe" in failed[0]["failed"] and "second gradient" in failed[0]["failed"]
    assert tune["best"]["config"]["mode"] == "off" and entry["mode"] == "off"
    assert "backward" in tune["ruled_out_modes"]
    [incident] = entry["incidents"]
    assert incident["left"] == "backward" and incident["chosen_by"] == "autotune" and incident["update_differs"]
    assert "differs from unpatched" in capsys.readouterr().err
    rows = list(csv.reader((tmp_path / "trials.csv").open()))
    assert [r[0] for r in rows[1:] if r[2] == "failed"] == ["backward"]


def test_a_trials_csv_that_disappears_mid_search_goes_off_and_the_search_goes_on(ap, tmp_path, capsys):
    """The trials CSV's directory disappears mid-search: writing the next row fails. The CSV goes
    off with one warning and the report says why; the search runs to its end, and training goes
    on exactly as unpatched."""
    logs = tmp_path / "logs"
    ap.enable("autotune", autotune={**FAST, "log_csv": str(logs / "trials.csv"),
                                    "save_best": str(tmp_path / "best.json")})
    torch.manual_seed(0)
    model = mlp(width=32, depth=8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, removed_at = [], None
    for i, batch in enumerate(batches(3000, width=32, batch=16)):
        losses += train(model, opt, [batch])
        if removed_at is None and ap.report()["autotune"].get("trials"):
            shutil.rmtree(logs)
            removed_at = i
        if removed_at is not None and ap.report()["autotune"]["phase"] == "frozen":
            break
    tune = ap.report()["autotune"]
    ap.disable()
    ref_model, ref_losses = job(len(losses))
    assert tune["phase"] == "frozen" and "failed" not in tune, tune
    assert len(tune["trials"]) >= 5 and tune["applied"][-1][1] == tune["best"]["config"]
    assert "FileNotFoundError" in tune["log_csv_failed"], tune
    assert json.loads((tmp_path / "best.json").read_text())["config"] == tune["best"]["config"]
    [warning] = [line for line in capsys.readouterr().err.splitlines() if "autotune" in line]
    assert warning.startswith(f"autopatch: autotune: the trials CSV {logs / 'trials.csv'} is off: FileNotFoundError")
    assert_same(losses, ref_losses)
    assert_same(weights(model), weights(ref_model))


def test_a_failure_inside_the_tuner_stops_the_search_and_keeps_training(ap, tmp_path, capsys):
    """A hand-edited resume file holds a chunk size that is no number: applying it fails inside
    the tuner. The search stops, keeps the config in effect, says why, and training goes on
    exactly as unpatched."""
    resume = tmp_path / "best.json"
    resume.write_text(json.dumps({"version": 1, "config": {"chunk_size_2p": "big"}}))
    ap.enable("autotune", autotune={**FAST, "resume": str(resume)})
    model, losses = job(until_frozen=ap)
    tune = ap.report()["autotune"]
    ap.disable()
    ref_model, ref_losses = job(len(losses))
    assert tune["phase"] == "frozen" and "TypeError" in tune["failed"], tune
    assert any("autotune stopped" in n for n in tune["notes"])
    assert "autopatch: autotune stopped after" in capsys.readouterr().err
    assert_same(losses, ref_losses)
    assert_same(weights(model), weights(ref_model))
