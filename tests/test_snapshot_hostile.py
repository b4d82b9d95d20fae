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

from conftest import git
from containers.sources import Folder, collect
from jobs.runs.code import LISTING, STORE, damage, plan_snapshot
from common.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SECRET = "hf_sEcReTvAlUe0123456789abcdefghij"  # what must never reach a terminal or the store


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
    git(checkout, "add", "trainer")
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
    git(checkout, "add", "trainer")
    refused(dry_run(checkout), "trainer/settings.py", "symbolic link", "replace the link")
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
    git(checkout, "add", "-f", "trainer")
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


@pytest.mark.slow
def test_a_huge_file_is_refused_naming_the_largest(checkout):
    big = checkout / "trainer" / "weights.bin"
    with open(big, "wb") as f:  # sparse: a gigabyte that costs nothing to make
        f.truncate(1 << 30)
    git(checkout, "add", "trainer")
    refused(dry_run(checkout), "the code to copy holds", "trainer/weights.bin (1.0 GiB)", "move data")


def test_an_untracked_script_beside_tracked_ones_is_refused(checkout):
    folder = checkout / "experiments"
    folder.mkdir()
    (folder / "common.py").write_text("X = 1\n")
    git(checkout, "add", "experiments")
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
    # A rank's import caches bytecode beside the sources (a user's shell): the snapshot is whole,
    # and a launch reusing it keeps it, its files the same ones (a warm process holds them).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, "-c", "import trainer.topology, common.errors"], cwd=snap, env=env, check=True)
    assert list(snap.glob("trainer/__pycache__/topology.*.pyc"))
    inode = model.stat().st_ino
    assert damage(snap, value.hash) is None
    assert plan_snapshot(checkout / "runs" / STORE, None, checkout).write() == value and model.stat().st_ino == inode
    cache = snap / "trainer" / "__pycache__"
    (cache / "topology.cpython-311.pyc.140234567").write_bytes(b"\0")  # a rank writing it at this instant
    assert damage(snap, value.hash) is None
    (cache / "topology.cpython-311.pyc.140234567").unlink()
    for added in (cache / "evil.py", cache / "deeper" / "x.pyc", cache / "x.pyc.sh"):
        added.parent.mkdir(exist_ok=True)
        added.write_text("x")
        assert damage(snap, value.hash) == f"{added} was added after submission"
        added.unlink()
    (cache / "link.pyc").symlink_to("/etc/passwd")
    assert damage(snap, value.hash) == f"{cache / 'link.pyc'} was added after submission"
    (cache / "link.pyc").unlink()
    outside = checkout / "elsewhere"
    (outside / "__pycache__").mkdir(parents=True)
    shutil.rmtree(snap / "common" / "__pycache__", ignore_errors=True)
    (snap / "common" / "__pycache__").symlink_to(outside / "__pycache__")  # a cache that is a link out
    assert damage(snap, value.hash) == f"{snap / 'common' / '__pycache__'} was added after submission"
    (snap / "common" / "__pycache__").unlink()
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
    git(checkout, "add", "jobs")
    with pytest.raises(ConfigError, match=r"^image: jobs/x.py is a symbolic link to /etc/passwd"):
        collect([Folder(checkout / "jobs", "src/jobs")], field_name="image", max_bytes=1 << 30, max_files=100)


# ------------------------------------------------------------------ by content, whatever the name

SA_KEY = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC" + "A" * 64 + "\n-----END PRIVATE KEY-----\n"
REMOTE_HEX = __import__("secrets").token_hex(20)
DOCKER_AUTH = __import__("base64").b64encode(f"$oauthtoken:nvapi-{SECRET[3:]}xyzxyzxyzxyzxyz".encode()).decode()


CONTENT_CASES = [
    ("secrets.yaml", "db_password: Tr0ub4dor3x\n"),  # by its name, and its line
    ("password.txt", "correct horse\n"), ("api_key.txt", "abc\n"), ("kubeconfig", "apiVersion: v1\n"),
    ("settings_local.py", f'DEBUG = True\nHF_TOKEN = "{SECRET}"\n'),
    ("config.json", '{"auths": {"nvcr.io": {"auth": "%s"}}}\n' % DOCKER_AUTH),  # a docker login
    ("gcp.json", '{"type": "service_account", "padding": "' + "x" * 9000 + '", "private_key": "' + SA_KEY + '"}'),
    ("db.py", 'PASSWORD = "Tr0ub4dor&3"\n'), ("deploy.sh", "export WANDB_API_KEY=" + "ab12" * 10 + "\n"),
    ("notebook.ipynb", '{"outputs": [{"text": "token: ' + SECRET + '"}]}'),
    ("tail.txt", "x\n" * 100_000 + "AKIAIOSFODNN7EXAMPLF\n"),  # far past the first 8 KiB
    ("wide.txt", ("token " + SECRET).encode("utf-16")),  # UTF-16: the letters spread apart
    ("ngc.yaml", "key: nvapi-" + SECRET[3:] + "abcdefghij\n"), ("dbx.cfg", "[x]\nhost=h\nt=dapi" + "0a1b" * 8 + "\n"),
    ("remote.txt", f"url = https://{REMOTE_HEX}@github.com/o/r.git\n"),  # an old GitHub token as the URL's user
]


@pytest.mark.slow
@pytest.mark.parametrize("name, content", CONTENT_CASES, ids=[name for name, _ in CONTENT_CASES])
def test_a_tracked_file_holding_a_secret_is_refused_by_its_content(checkout, name, content):
    path = checkout / "trainer" / "data" / name
    path.parent.mkdir()
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    git(checkout, "add", "-f", "trainer")
    line = refused(dry_run(checkout), f"trainer/data/{name}", "looks like a secret", "git rm --cached")
    for part in (SECRET, DOCKER_AUTH, "Tr0ub4dor", "MIIEvQ", "nvapi-", "dapi", REMOTE_HEX):
        assert part not in line
    assert not (checkout / "runs").exists()


def test_a_hard_link_to_a_file_outside_is_refused(checkout, tmp_path):
    """The other name of a hard link may be anything of the user's (a token in $HOME): its content
    is that file's, whatever the innocent name here. Both names inside what is copied are fine."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "pw").write_text("correct horse\n")  # nothing a content scan could tell
    os.link(home / "pw", checkout / "trainer" / "notes.txt")
    git(checkout, "add", "trainer")
    refused(dry_run(checkout), "trainer/notes.txt", "hard link", "a file of its own")
    os.unlink(checkout / "trainer" / "notes.txt")
    (checkout / "trainer" / "notes.txt").write_text("notes\n")
    os.link(checkout / "trainer" / "notes.txt", checkout / "common" / "notes_copy.txt")
    git(checkout, "add", "trainer", "common")
    assert dry_run(checkout).returncode == 0


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _socket(path: Path) -> None:
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(os.path.relpath(path))  # (a socket's path is bounded: the test's folder is long)
    s.close()


def _device(path: Path) -> None:
    try:
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
    except PermissionError:
        pytest.skip("making a device node needs root")


@pytest.mark.parametrize("make, kind", [(_fifo, "a FIFO"), (_socket, "a socket"), (_device, "a character device")])
def test_a_tracked_file_turned_special_is_named_never_dropped_or_read(checkout, make, kind):
    """A FIFO would block a reader forever; a device is no file of the project's: named, in one
    line, the snapshot never taken without it."""
    path = checkout / "trainer" / "model.py"
    path.unlink()
    make(path)
    refused(dry_run(checkout), "trainer/model.py", f"is {kind}", "not a file")


def test_a_submodule_is_copied_and_one_not_checked_out_is_named(checkout, tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "helper.py").write_text("X = 1\n")
    git(lib, "init", "-q")
    git(lib, "add", ".")
    git(lib, "commit", "-qm", "lib")
    git(checkout, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib), "trainer/vendor")
    git(checkout, "commit", "-qm", "sub")
    value = plan_snapshot(checkout / "runs" / STORE, None, checkout).write()
    assert (Path(value.dir) / "trainer" / "vendor" / "helper.py").read_text() == "X = 1\n"
    # Not checked out (a fresh clone without --recurse-submodules): named, not left out in silence.
    git(checkout, "submodule", "deinit", "-q", "-f", "trainer/vendor")
    refused(dry_run(checkout), "trainer/vendor", "submodule", "git submodule update --init")


def test_a_repository_inside_the_checkout_is_named(checkout):
    nested = checkout / "trainer" / "nested"
    nested.mkdir()
    (nested / "x.py").write_text("X = 1\n")
    git(nested, "init", "-q")
    git(nested, "add", ".")
    git(nested, "commit", "-qm", "n")
    git(checkout, "add", "trainer/nested")  # git records it by its commit alone
    refused(dry_run(checkout), "trainer/nested", "by its commit alone", "git rm --cached")


# ------------------------------------------------------------------ outside git: only a project's folder


def test_a_script_in_the_home_directory_is_refused_not_the_home_copied(project, tmp_path):
    """`train.script=~/train.py` would copy all of $HOME (an aws_keys.txt among it): refused in
    one line saying where to put the script; nothing written, nothing of $HOME shown."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "train.py").write_text("print(1)\n")
    (home / "aws_keys.txt").write_text("AKIAIOSFODNN7EXAMPLF\n")
    proc = subprocess.run([sys.executable, "-m", "jobs", "submit", "tiny_cpu", "--dry-run", "train.script=~/train.py"],
                          cwd=project, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(home)})
    refused(proc, "train.script", "home directory", "folder of its own")
    assert "AKIA" not in proc.stdout + proc.stderr and not (project / "runs").exists()


@pytest.mark.parametrize("setup, why", [
    (lambda d: (d / ".ssh").mkdir(), "holds credentials"),
    (lambda d: (d / ".netrc").write_text("machine x"), "holds credentials"),
    (lambda d: [(d / f"f{i}.txt").write_text("x") for i in range(1001)], "holds more than 1000 files"),
])
def test_a_folder_that_is_no_project_s_is_refused(project, setup, why):
    folder = project.parent / "scratch"
    folder.mkdir()
    (folder / "train_mine.py").write_text("print(1)\n")
    setup(folder)
    with pytest.raises(ConfigError, match=rf"^train.script: .*scratch {why}.*not a project's folder.*folder of its own"):
        plan_snapshot(project / "runs" / STORE, str(folder / "train_mine.py"))


# ------------------------------------------------------------------ the scan, kept by content


@pytest.mark.slow
def test_an_unchanged_checkout_is_not_scanned_again(checkout, tmp_path, monkeypatch):
    from containers import sources

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    scanned = []
    real = sources.file_findings
    monkeypatch.setattr(sources, "file_findings", lambda data, name="": scanned.append(name) or real(data, name))
    first = plan_snapshot(checkout / "runs" / STORE, None, checkout)
    assert len(scanned) == first.value.files > 20
    scanned.clear()
    assert plan_snapshot(checkout / "runs" / STORE, None, checkout).value == first.value and scanned == []
    (checkout / "trainer" / "model.py").write_text((checkout / "trainer" / "model.py").read_text() + "\n# edited\n")
    plan_snapshot(checkout / "runs" / STORE, None, checkout)
    assert scanned == ["model.py"]  # the file that changed, alone
    # A damaged record is read for its well-formed lines only; an unwritable cache scans every time.
    record = next((tmp_path / "cache" / "slipway").iterdir())
    record.write_text("garbage\n" + "z" * 64 + "\n")
    scanned.clear()
    plan_snapshot(checkout / "runs" / STORE, None, checkout)
    assert len(scanned) == first.value.files
    # A FIFO in the record's place is neither waited on when read nor when written: every file scanned.
    record.unlink()
    os.mkfifo(record)
    scanned.clear()
    plan_snapshot(checkout / "runs" / STORE, None, checkout)
    assert len(scanned) == first.value.files and record.is_fifo()
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/no-such-cache")
    scanned.clear()
    plan_snapshot(checkout / "runs" / STORE, None, checkout)
    assert len(scanned) == first.value.files


def test_a_secret_is_never_taken_for_clean_by_the_record(checkout, tmp_path, monkeypatch):
    """Only contents found clean are recorded: a file refused once is refused again, and a clean
    file that turns into a secret one (new content, new sha256) is scanned."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    plan_snapshot(checkout / "runs" / STORE, None, checkout)
    (checkout / "trainer" / "model.py").write_text(f'TOKEN = "{SECRET}"\n')
    for _ in range(2):
        with pytest.raises(ConfigError, match="trainer/model.py looks like a secret"):
            plan_snapshot(checkout / "runs" / STORE, None, checkout)
