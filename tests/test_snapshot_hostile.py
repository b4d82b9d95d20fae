"""What a code snapshot and an image take of a checkout, with hostile files in it (containers/sources.py).

Through the command a user types (`slipway submit --dry-run`, which plans the snapshot exactly as a
submission does) and through the store itself: links out of the checkout, secret-looking files,
a huge file, untracked files, a directory the user cannot read, a checkout without git, and the
modes the store's files get under the user's umask.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from containers.sources import Folder, collect
from jobs.runs.code import LISTING, STORE, damage, plan_snapshot
from common.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SECRET = "hf_sEcReTvAlUe0123456789abcdefghij"  # what must never reach a terminal or the store


def _git(project: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(project), *args], check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"})


@pytest.fixture
def checkout(project: Path) -> Path:
    """The project as a git checkout of slipway's code folders (what a user clones)."""
    for name in ("common", "trainer"):
        shutil.copytree(ROOT / name, project / name, ignore=shutil.ignore_patterns("__pycache__"))
    _git(project, "init", "-q")
    _git(project, "add", "common", "trainer", "configs")
    _git(project, "commit", "-qm", "c")
    return project


def dry_run(project: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs", "submit", "tiny_cpu", "--dry-run", *extra], cwd=project,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "SLIPWAY_TEST_SECRET": SECRET})


def refused(proc: subprocess.CompletedProcess, *words: str) -> str:
    """The one error line of a refused command; it names what it must and never the secret."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("slipway: error: "), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    assert SECRET not in proc.stdout + proc.stderr
    return lines[0]


def test_a_link_inside_is_kept_as_a_link_to_the_copy(checkout):
    (checkout / "trainer" / "alias.py").symlink_to("model.py")
    (checkout / "trainer" / "kern").symlink_to("../common")  # a link to a directory that is copied too
    (checkout / "trainer" / "abs.py").symlink_to(checkout / "common" / "fs.py")  # absolute, inside
    _git(checkout, "add", "trainer")
    value = plan_snapshot(checkout / "runs" / STORE, None, checkout).write()
    snap = Path(value.dir)
    assert os.readlink(snap / "trainer" / "alias.py") == "model.py"
    assert os.readlink(snap / "trainer" / "kern") == "../common"
    assert os.readlink(snap / "trainer" / "abs.py") == "../common/fs.py"  # now points at the copy
    assert (snap / "trainer" / "abs.py").read_text() == (checkout / "common" / "fs.py").read_text()
    assert damage(snap, value.hash) is None


@pytest.mark.parametrize("target", ["home-token", "/proc/self/environ", "nowhere", "loop"])
def test_a_link_out_of_the_checkout_is_refused_naming_it(checkout, tmp_path, target):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".hf_token").write_text(SECRET)
    link = checkout / "trainer" / "settings.py"
    if target == "home-token":
        link.symlink_to(home / ".hf_token")
    elif target == "loop":
        link.symlink_to("settings.py")
    elif target == "nowhere":
        link.symlink_to("missing.py")
    else:
        link.symlink_to(target)
    _git(checkout, "add", "trainer")
    line = refused(dry_run(checkout), "trainer/settings.py", "symbolic link", "replace the link")
    assert not (checkout / "runs").exists()  # nothing half-written


def test_untracked_files_are_left_out_and_named(checkout):
    (checkout / "trainer" / "credentials.json").write_text('{"token": "%s"}' % SECRET)
    (checkout / "trainer" / "my_new_module.py").write_text("X = 1\n")
    proc = dry_run(checkout)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    assert "not in the code snapshot" in out and "trainer/my_new_module.py" in out and "git add" in out
    assert SECRET not in out
    snap = plan_snapshot(checkout / "runs" / STORE, None, checkout)
    value = snap.write()
    assert not (Path(value.dir) / "trainer" / "credentials.json").exists()
    assert not (Path(value.dir) / "trainer" / "my_new_module.py").exists()


@pytest.mark.parametrize("name, content", [
    (".env", f"HF_TOKEN={SECRET}\n"), ("id_ed25519", "key"), ("deploy.pem", "x"), (".netrc", "machine x"),
    ("credentials.json", "{}"), ("notes.txt", "-----BEGIN OPENSSH PRIVATE KEY-----\nabc\n"),
    ("hf.token", SECRET)])
def test_a_tracked_secret_looking_file_is_refused_with_how_to_leave_it_out(checkout, name, content):
    (checkout / "trainer" / name).write_text(content)
    _git(checkout, "add", "-f", "trainer")
    refused(dry_run(checkout), f"trainer/{name}", "looks like a secret", "git rm --cached")
    assert not (checkout / "runs").exists()


def test_outside_git_the_same_rules_hold(project, monkeypatch):
    """A train.script's folder outside any checkout: every file but hidden ones; a secret-looking
    one refused (with the advice that fits no git), a link out refused."""
    folder = project.parent / "scripts"
    folder.mkdir()
    (folder / "train_mine.py").write_text("print(1)\n")
    (folder / ".hidden").write_text("x")
    value = plan_snapshot(project / "runs" / STORE, str(folder / "train_mine.py")).write()
    assert (Path(value.dir) / "script" / "train_mine.py").is_file()
    assert not (Path(value.dir) / "script" / ".hidden").exists()
    (folder / "service_account.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^train.script: .*service_account.json looks like a secret.*move it out"):
        plan_snapshot(project / "runs" / STORE, str(folder / "train_mine.py"))
    (folder / "service_account.json").unlink()
    (folder / "data").symlink_to("/etc")
    with pytest.raises(ConfigError, match=r"^train.script: .*data is a symbolic link to /etc"):
        plan_snapshot(project / "runs" / STORE, str(folder / "train_mine.py"))


def test_a_huge_file_is_refused_naming_the_largest(checkout):
    big = checkout / "trainer" / "weights.bin"
    with open(big, "wb") as f:  # sparse: a gigabyte that costs nothing to make
        f.truncate(1 << 30)
    _git(checkout, "add", "trainer")
    refused(dry_run(checkout), "the code to copy holds", "trainer/weights.bin (1.0 GB)", "move data")


def test_an_untracked_script_beside_tracked_ones_is_refused(checkout):
    folder = checkout / "experiments"
    folder.mkdir()
    (folder / "common.py").write_text("X = 1\n")
    _git(checkout, "add", "experiments")
    (folder / "train_new.py").write_text("import common\n")
    proc = dry_run(checkout, "train.script=experiments/train_new.py")
    refused(proc, "train.script", "not tracked by git", "git add")


def test_a_script_in_an_untracked_folder_of_the_checkout_is_walked(checkout):
    folder = checkout / "scratch"
    folder.mkdir()
    (folder / "train_new.py").write_text("print(1)\n")
    value = plan_snapshot(checkout / "runs" / STORE, str(folder / "train_new.py"), checkout).write()
    assert (Path(value.dir) / "script" / "train_new.py").is_file()


def test_a_file_name_with_a_newline_is_refused(project):
    folder = project.parent / "scripts"
    folder.mkdir()
    (folder / "train_mine.py").write_text("print(1)\n")
    (folder / "bad\nname.py").write_text("x")
    with pytest.raises(ConfigError, match=r"newline or a backslash"):
        plan_snapshot(project / "runs" / STORE, str(folder / "train_mine.py"))


@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, 0o444, 0o755), (0o077, 0o400, 0o700),
                                                        (0o027, 0o440, 0o750)])
def test_the_store_follows_the_users_umask(checkout, umask, file_mode, dir_mode):
    old = os.umask(umask)
    try:
        value = plan_snapshot(checkout / "runs" / STORE, None, checkout).write()
    finally:
        os.umask(old)
    snap = Path(value.dir)
    assert stat.S_IMODE((snap / "trainer" / "model.py").stat().st_mode) == file_mode
    assert stat.S_IMODE((snap / LISTING).stat().st_mode) == file_mode
    assert stat.S_IMODE((snap / "trainer").stat().st_mode) == dir_mode
    assert stat.S_IMODE(snap.stat().st_mode) == dir_mode


def test_a_snapshot_changed_in_place_is_found_and_rewritten(checkout):
    """The host's side of the node's check: damage() names the file; a launch reusing the
    snapshot writes it anew rather than running what changed."""
    value = plan_snapshot(checkout / "runs" / STORE, None, checkout).write()
    snap = Path(value.dir)
    model = snap / "trainer" / "model.py"
    os.chmod(model, 0o644)
    model.write_text(model.read_text() + "\nimport os\n")
    assert damage(snap, value.hash) == f"{model} differs from the file submitted"
    again = plan_snapshot(checkout / "runs" / STORE, None, checkout).write()
    assert again == value and damage(snap, value.hash) is None
    (snap / "trainer" / "added.py").parent.chmod(0o755)
    (snap / "trainer" / "added.py").write_text("x")
    assert damage(snap, value.hash) == f"{snap / 'trainer' / 'added.py'} was added after submission"
    (snap / "trainer" / "added.py").unlink()
    (snap / "trainer" / "data.py").unlink()
    assert damage(snap, value.hash) == f"{snap / 'trainer' / 'data.py'} is missing"


def test_an_unreadable_directory_is_refused_naming_it(tmp_path):
    """Outside git, as a user who cannot read a folder of the code (root reads everything, so the
    walk runs as nobody)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the walk as another user")
    top = Path("/tmp") / f"slipway-unreadable-{os.getpid()}"
    shutil.rmtree(top, ignore_errors=True)
    (top / "code" / "secret_dir").mkdir(parents=True)
    (top / "code" / "train_mine.py").write_text("x")
    try:
        for path in (top, top / "code"):
            path.chmod(0o755)
        (top / "code" / "secret_dir").chmod(0o700)
        script = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1])\n"
                  "from containers.sources import Folder, collect\n"
                  "from common.errors import ConfigError\n"
                  "try: collect([Folder(Path(sys.argv[2]), 'script')], field_name='train.script', "
                  "max_bytes=1 << 30, max_files=100)\n"
                  "except ConfigError as e: print(e); sys.exit(2)\n")
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                               script, str(ROOT), str(top / "code")], capture_output=True, text=True, timeout=60)
        if "Permission denied" in proc.stderr and "python" in proc.stderr.lower() and proc.returncode != 2:
            pytest.skip(f"nobody cannot run this Python: {proc.stderr.strip()[-200:]}")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stdout.startswith("train.script: cannot read ") and "secret_dir" in proc.stdout
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_the_image_context_follows_the_same_rules(checkout):
    """containers/context.py takes the same walk: a link out of jobs/ is refused for the image too."""
    (checkout / "jobs").mkdir()
    (checkout / "jobs" / "x.py").symlink_to("/etc/passwd")
    _git(checkout, "add", "jobs")
    with pytest.raises(ConfigError, match=r"^image: jobs/x.py is a symbolic link to /etc/passwd"):
        collect([Folder(checkout / "jobs", "src/jobs")], field_name="image", max_bytes=1 << 30, max_files=100)
