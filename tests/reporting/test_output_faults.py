"""Logging and reporting never stop training: a TensorBoard log dir or a report path that cannot
be written (under a regular file, read-only, on a full disk, or a disk that fills mid-run) gives
one warning, the writer goes off, training goes on exactly as unpatched, and the report says
what failed."""

import json
import time

import pytest
import torch

from faulty_dirs import FAULTS, SAYS, fill, small_tmpfs, unwritable
from spawn import clean_env, patience, run_python, write_script
from training import assert_same, batches, mlp, train, weights

pytest.importorskip("tensorboard")


pytestmark = pytest.mark.usefixtures("one_thread")


class Job:
    """One seeded model trained step by step, so a test can act between steps."""

    def __init__(self):
        self.model = mlp(width=16, depth=4)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.data = iter(batches(100_000, width=16))
        self.losses = []

    def run(self, seconds=0.0, steps=0, until=None):
        """At least ``steps`` steps and ``seconds`` seconds, then until ``until()`` (bounded)."""
        start, done = time.perf_counter(), 0
        deadline = start + patience(60)
        while done < steps or time.perf_counter() - start < seconds or (until is not None and not until()):
            self.losses += train(self.model, self.opt, [next(self.data)])
            done += 1
            if time.perf_counter() > deadline:
                break
        return self


def unpatched(steps):
    ref = Job()
    ref.losses = train(ref.model, ref.opt, [next(ref.data) for _ in range(steps)])
    return ref


def warnings_in(err):
    return [line for line in err.splitlines() if "TensorBoard logging to" in line]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_log_dir_that_cannot_be_written_never_reaches_training(ap, tmp_path, capfd, fault):
    with unwritable(tmp_path, fault) as place:
        logdir = place / "logs"
        ap.enable(logdir=str(logdir))
        job = Job().run(seconds=1.2, steps=60)
        report = ap.report()
        ap.disable()
    err = capfd.readouterr().err
    failed = report["tensorboard"]["failed"]
    assert failed and any(s in failed for s in SAYS[fault]), report["tensorboard"]
    assert report["tensorboard"]["logdir"] == str(logdir)
    [warning] = warnings_in(err)
    assert f"TensorBoard logging to {logdir} is off for the rest of the run: {failed}" in warning
    assert "Traceback" not in err
    assert report["optimizers"][0]["steps"] == len(job.losses)
    ref = unpatched(len(job.losses))
    assert_same(job.losses, ref.losses)
    assert_same(weights(job.model), weights(ref.model))


def test_a_disk_that_fills_mid_run_turns_tensorboard_off(ap, tmp_path, capfd):
    # 1 MiB: the records of the first 1.2 s must fit (on a fast machine 64 KiB did not), then fill()
    with small_tmpfs(tmp_path / "disk", size="1m") as disk:
        logdir = disk / "logs"
        ap.enable(logdir=str(logdir))
        job = Job().run(seconds=1.2, steps=40)
        kinds = {json.loads(line)["kind"] for line in (logdir / "autopatch.jsonl").read_text().splitlines()}
        assert {"start", "window"} <= kinds and ap.report()["tensorboard"]["failed"] is None
        fill(disk)
        job.run(until=lambda: ap.report()["tensorboard"]["failed"] is not None)
        job.run(steps=50)                                 # and training goes on
        report = ap.report()
        ap.disable()
    err = capfd.readouterr().err
    assert "No space left on device" in (report["tensorboard"]["failed"] or ""), report["tensorboard"]
    assert len(warnings_in(err)) == 1 and "Traceback" not in err, err
    ref = unpatched(len(job.losses))
    assert_same(job.losses, ref.losses)
    assert_same(weights(job.model), weights(ref.model))


def test_a_link_where_the_records_go_is_not_followed(ap, tmp_path, capfd):
    """autopatch.jsonl planted as a link to another file: the writer refuses it and goes off;
    the file the link points at is untouched."""
    logdir, victim = tmp_path / "logs", tmp_path / "victim"
    logdir.mkdir()
    victim.write_text("precious\n")
    (logdir / "autopatch.jsonl").symlink_to(victim)
    ap.enable(logdir=str(logdir))
    Job().run(seconds=1.2, steps=60)
    report = ap.report()
    ap.disable()
    assert victim.read_text() == "precious\n"
    assert "Too many levels of symbolic links" in report["tensorboard"]["failed"], report["tensorboard"]
    assert len(warnings_in(capfd.readouterr().err)) == 1


SCRIPT = """
import time
import torch
from training import batches, mlp, train
torch.set_num_threads(1)
model = mlp(width=16, depth=4)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
data, steps, start = iter(batches(100_000, width=16)), 0, time.perf_counter()
while steps < 30 or time.perf_counter() - start < 1.0:    # past TensorBoard's first window
    train(model, opt, [next(data)])
    steps += 1
print("trained", steps, "steps")
"""


@pytest.mark.parametrize("fault", FAULTS)
def test_a_report_that_cannot_be_written_is_said_at_exit(tmp_path, fault):
    """The report and the TensorBoard logs of a zero-code run both go where nothing can be
    written: each is said once, the summary says what was not written, the exit code is 0."""
    script = write_script(tmp_path / "job.py", SCRIPT)
    with unwritable(tmp_path, fault) as place:
        target = place / "report.json"
        res = run_python([script], env=clean_env(FUSEDOPT_ENABLE=1, FUSEDOPT_REPORT=target,
                                                 FUSEDOPT_LOGDIR=place / "logs"))
        left = sorted(p.name for p in place.iterdir()) if place.is_dir() else None
    assert res.returncode == 0 and res.stdout.startswith("trained "), res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    [said] = [line for line in res.stderr.splitlines() if line.startswith("autopatch: the report")]
    assert said.startswith(f"autopatch: the report was not written to {target}: ")
    assert any(s in said for s in SAYS[fault]), said
    assert len(warnings_in(res.stderr)) == 1      # said when it failed; the summary says it again below
    assert res.stderr.count("autopatch: policy default, 1 optimizer(s)") == 1     # the summary still
    assert f"  not written (training went on): TensorBoard logs in {place / 'logs'}: " in res.stderr
    assert not [name for name in left or [] if "report" in name], left    # no half report, no temp file


def test_a_report_is_whole_or_not_at_all(tmp_path):
    """On a disk that fills, the previous report stays as it was and no temp file is left."""
    script = write_script(tmp_path / "job.py", SCRIPT)
    with small_tmpfs(tmp_path / "disk") as disk:
        (disk / "report.json").write_text('{"previous": true}')
        fill(disk)
        res = run_python([script], env=clean_env(FUSEDOPT_ENABLE=1, FUSEDOPT_REPORT=disk / "report.json"))
        assert json.loads((disk / "report.json").read_text()) == {"previous": True}
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "report.json"]
    assert res.returncode == 0 and "No space left on device" in res.stderr and "Traceback" not in res.stderr


def test_a_link_planted_at_the_report_path_is_replaced_not_followed(tmp_path):
    script = write_script(tmp_path / "job.py", SCRIPT)
    victim, target = tmp_path / "victim", tmp_path / "report.json"
    victim.write_text("precious\n")
    target.symlink_to(victim)
    res = run_python([script], env=clean_env(FUSEDOPT_ENABLE=1, FUSEDOPT_REPORT=target))
    assert res.returncode == 0, res.stderr
    assert victim.read_text() == "precious\n"
    assert not target.is_symlink() and json.loads(target.read_text())["optimizers"][0]["steps"] >= 30
