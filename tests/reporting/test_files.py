"""The files autopatch writes: never through a planted link, whole or not at all, and the
private per-user directory refused whenever another user could have a hand in it."""

import os
import tempfile

import pytest

from autopatch.reporting.files import Folder, folder_of, private_folder
from faulty_dirs import NOBODY, as_nobody, fill, shared_temp_dir, small_tmpfs


@pytest.fixture
def temp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_the_private_directory_is_made_0700_and_its_files_0600(temp):
    with private_folder() as folder:
        name, f = folder.create("x", ".log")
        f.close()
        written = folder.write_whole("best.json", b"{}")
    private = temp / f"autopatch-{os.getuid()}"
    assert folder.path == str(private) and written == str(private / "best.json")
    assert private.stat().st_mode & 0o777 == 0o700
    assert (private / name).stat().st_mode & 0o777 == 0o600 and (private / "best.json").stat().st_mode & 0o777 == 0o600
    with private_folder() as again:           # the same one next time
        assert again.path == folder.path


def test_a_private_directory_open_to_others_is_refused(temp):
    (temp / f"autopatch-{os.getuid()}").mkdir(mode=0o755)
    (temp / f"autopatch-{os.getuid()}").chmod(0o755)
    with pytest.raises(PermissionError, match="is open to other users .mode 755, not 700."):
        private_folder()


def test_a_link_in_place_of_the_private_directory_is_refused(temp):
    elsewhere = temp / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (temp / f"autopatch-{os.getuid()}").symlink_to(elsewhere)
    with pytest.raises(PermissionError, match="is a symbolic link"):
        private_folder()


def test_a_private_directory_another_user_owns_is_refused(monkeypatch):
    with shared_temp_dir(0o1777) as shared:
        monkeypatch.setattr(tempfile, "tempdir", shared)
        as_nobody("mkdir", "-m", "700", os.path.join(shared, f"autopatch-{os.getuid()}"))
        with pytest.raises(PermissionError, match=f"owned by uid {NOBODY}, not by this user"):
            private_folder()


def test_a_link_where_a_file_goes_is_refused_or_replaced_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    for name in ("opened", "appended"):
        (tmp_path / name).symlink_to(victim)
    (tmp_path / "replaced").symlink_to(victim)
    with Folder(str(tmp_path)) as folder:
        with pytest.raises(OSError, match="Too many levels of symbolic links"):
            folder.open("opened")
        with pytest.raises(OSError, match="Too many levels of symbolic links"):
            folder.open("appended", append=True)
        folder.write_whole("replaced", b"new\n")
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / "replaced").is_symlink() and (tmp_path / "replaced").read_text() == "new\n"


def test_write_whole_on_a_full_disk_leaves_the_old_file_and_no_temp_file(tmp_path):
    with small_tmpfs(tmp_path / "disk") as disk:
        (disk / "report.json").write_text("old\n")
        fill(disk)
        folder, name = folder_of(str(disk / "report.json"))
        with folder, pytest.raises(OSError, match="No space left on device"):
            folder.write_whole(name, b"x" * 100_000)
        assert (disk / "report.json").read_text() == "old\n"
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "report.json"]
