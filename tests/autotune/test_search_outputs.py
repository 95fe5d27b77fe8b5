"""What a search writes never stops it, and cannot be redirected: a trials CSV or best config
that cannot be written goes off with one warning each (the report says why) while the search
runs to its end; with no place named, the best config goes to this user's private directory,
so links another local user plants in the shared temp dir are never followed."""

import json
import os
import tempfile

import pytest

from faulty_dirs import FAULTS, NOBODY, SAYS, as_nobody, shared_temp_dir, unwritable
from autotune_job import FAST, job
from training import assert_same, weights

pytest.importorskip("bayes_opt")


def search(ap, **autotune):
    """A whole short search, then the same steps unpatched; training is checked equal to
    unpatched here (job() drops its optimizer, pending forward updates and all). Returns the
    autotune report."""
    ap.enable("autotune", autotune={**FAST, **autotune})
    model, losses = job(until_frozen=ap)
    tune = ap.report()["autotune"]
    ap.disable()
    ref_model, ref_losses = job(len(losses))
    assert_same(losses, ref_losses)
    assert_same(weights(model), weights(ref_model))
    assert tune["phase"] == "frozen" and "failed" not in tune and len(tune["trials"]) >= 5, tune
    return tune


def autotune_lines(err):
    return [line for line in err.splitlines() if line.startswith("autopatch: autotune")]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_trials_csv_and_best_config_that_cannot_be_written(ap, tmp_path, capfd, fault):
    with unwritable(tmp_path, fault) as place:
        tune = search(ap, log_csv=str(place / "trials.csv"), save_best=str(place / "best.json"))
    err = capfd.readouterr().err
    assert any(s in tune["log_csv_failed"] for s in SAYS[fault]), tune
    assert any(s in tune["best_json_failed"] for s in SAYS[fault]), tune
    assert tune["best_json"] is None
    csv_warning, best_warning = autotune_lines(err)
    assert csv_warning.startswith(f"autopatch: autotune: the trials CSV {place / 'trials.csv'} is off: ")
    assert best_warning.startswith(f"autopatch: autotune: saving the best config to {place / 'best.json'} is off: ")
    assert "Traceback" not in err


@pytest.fixture
def shared_temp(request, monkeypatch):
    """A temp dir that every local user can write to, as this process's temp dir."""
    with shared_temp_dir(request.param) as path:
        monkeypatch.setattr(tempfile, "tempdir", path)
        yield path


@pytest.mark.parametrize("shared_temp", [0o1777, 0o777], indirect=True, ids=["sticky", "not-sticky"])
def test_links_another_user_plants_in_the_temp_dir_are_never_followed(ap, tmp_path, shared_temp):
    """nobody plants links where a best config went (a fixed name, and its temp file named by
    this pid) and where a private directory's file goes; root's search writes none of them."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    planted = [os.path.join(shared_temp, name) for name in
               ("autopatch_autotune_best.json", f"autopatch_autotune_best.json.tmp{os.getpid()}")]
    for link in planted:
        as_nobody("ln", "-s", victim, link)
    tune = search(ap)
    private = os.path.join(shared_temp, f"autopatch-{os.getuid()}")
    assert victim.read_text() == "precious\n"
    assert all(os.path.islink(link) for link in planted)
    assert tune["best_json"] == os.path.join(private, "autotune_best.json"), tune
    assert os.stat(private).st_mode & 0o777 == 0o700 and os.stat(private).st_uid == os.getuid()
    assert os.stat(tune["best_json"]).st_mode & 0o777 == 0o600
    assert json.loads(open(tune["best_json"]).read())["config"] == tune["best"]["config"]


@pytest.mark.parametrize("shared_temp", [0o1777], indirect=True, ids=["sticky"])
def test_a_private_directory_another_user_made_first_is_refused(ap, tmp_path, capfd, shared_temp):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    private = os.path.join(shared_temp, f"autopatch-{os.getuid()}")
    as_nobody("mkdir", "-m", "700", private)
    as_nobody("ln", "-s", victim, os.path.join(private, "autotune_best.json"))
    tune = search(ap)
    assert victim.read_text() == "precious\n"
    assert tune["best_json"] is None
    assert f"is owned by uid {NOBODY}, not by this user" in tune["best_json_failed"], tune
    [warning] = autotune_lines(capfd.readouterr().err)
    assert warning.startswith("autopatch: autotune: saving the best config is off: NotPrivate: ")


def test_a_link_planted_where_the_trials_csv_goes_is_refused(ap, tmp_path):
    victim, link = tmp_path / "victim", tmp_path / "trials.csv"
    victim.write_text("precious\n")
    link.symlink_to(victim)
    tune = search(ap, log_csv=str(link), save_best=str(tmp_path / "best.json"))
    assert victim.read_text() == "precious\n"
    assert "Too many levels of symbolic links" in tune["log_csv_failed"], tune
