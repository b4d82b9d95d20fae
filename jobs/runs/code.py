"""The code a run runs: a snapshot of the sources, taken at each launch, shared by content.

An image holds the dependencies (torch, flash-attn, CUDA); the code the job runs (the `trainer`
package, and a `train.script` with its folder) is copied at submit, `slipway local` and `slipway
run` into RUNS/.code/HASH/, one copy per distinct content, and put in front of the image's baked
`trainer`: a mount at its own path and PYTHONPATH (containers), the job's PYTHONPATH (runtime
none). PYTHONSAFEPATH keeps the working directory (the checkout, for runtime none) from shadowing
it; SLIPWAY_CODE lets the trainer check that it runs from the snapshot (common/rundir.py
`check_code`). A snapshot is never written twice and job.sbatch and env.toml name its path, so
editing the checkout changes nothing for a submitted run, its requeues or its retries.
`code.snapshot: false` runs the image's baked code (sealed production images). A lock on the store
(shared while a launch writes or reuses a snapshot, exclusive while one prunes those no run names)
keeps a pruning from taking a snapshot a launch has just chosen.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import hashlib
import os
import re
import time
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional, Sequence

from containers.sources import MAX_BYTES, MAX_FILES, Folder, SourceFile, collect, copy_into
from containers.tools import git, git_state
from jobs.runs import manifest as manifests
from jobs.runs.lock import try_flock
from common.errors import ConfigError, bounded_path
from common.fs import file_sha256
from common.rundir import CodeSnapshot, RunDir

STORE = ".code"  # under the runs root: RUNS/.code/HASH16/
# The snapshot's hash: the sha256 of SCHEME's line and its listing LISTING, a line `KIND SHA256 PATH`
# per entry (f: a file, x: an executable, l: a link, hashed by its target's text), so that a node
# checks it with bash and sha256sum alone (jobs/slurm/verify_lib.sh verify_code).
SCHEME = "slipway-code-v2"
LISTING = ".slipway-files"
# A snapshot no manifest names is kept this long after a launch last wrote or reused it: a launch
# records its snapshot only once sbatch has answered, which a busy controller can delay.
PRUNE_AFTER_SECONDS = 24 * 3600
_LOCK = ".lock"
_REMOVING = ".removing-"


def trainer_source(project_dir: Optional[Path] = None) -> Path:
    """The `trainer` package a launch from `project_dir` runs: the checkout's own where there is one
    (what the user edits, whether slipway is installed editable or not), else the one it imports."""
    if project_dir is not None and (project_dir / "trainer" / "__init__.py").is_file():
        return (project_dir / "trainer").resolve()
    # Found, not imported: the host reaches into trainer/ for its config alone (jobs/trainer_door.py).
    spec = importlib.util.find_spec("trainer")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("code.snapshot", "this slipway has no trainer package to snapshot: reinstall slipway, or "
                                           "set code.snapshot: false to run the image's own code")
    return Path(list(spec.submodule_search_locations)[0]).resolve()


def git_diff(snapshot: CodeSnapshot) -> str:
    """The snapshotted packages' difference from their commit (tracked files: all a snapshot holds)."""
    source = Path(snapshot.source)
    if not snapshot.commit:
        return ""
    parts = [name for name in ("common", source.name) if (source.parent / name).is_dir()]
    return git(source.parent, "diff", "HEAD", "--", *parts) or ""


class Snapshot:
    """A snapshot planned, nothing written: `value` for the manifest; `untracked`, git-untracked files left out."""

    def __init__(self, value: CodeSnapshot, files: list[SourceFile], listing: str, untracked: list[str]):
        self.value = value
        self._files = files
        self._listing = listing
        self.untracked = untracked
        self.created = False  # this launch wrote it (a refused submission takes it back)
        self._written = 0  # its mtime then: a later one means another launch reused it
        self._ready = False  # written or checked by this process: the points of a sweep share it

    def discard(self) -> None:
        """Remove the snapshot if this launch wrote it and no other launch has reused it since."""
        self._ready = False
        if not self.created:
            return
        target = Path(self.value.dir)
        with store_lock(target.parent, exclusive=True):
            with contextlib.suppress(OSError):
                if target.stat().st_mtime_ns == self._written:
                    _remove(target)
                # A store left empty goes too (a refused first submission leaves no trace); with no
                # snapshot in it there is nothing old whose reuse the lock would have to guard.
                if os.listdir(target.parent) == [_LOCK]:
                    os.unlink(target.parent / _LOCK)
                    target.parent.rmdir()

    def write(self) -> CodeSnapshot:
        if self._ready:
            return self.value
        target = Path(self.value.dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        with store_lock(target.parent, exclusive=False):
            if target.is_dir():
                if damage(target, self.value.hash) is None:  # content-addressed: the same hash, the same files
                    os.utime(target)  # reused now: a pruning leaves it its grace
                    self._ready = True
                    return self.value
                # Changed in place since it was written (an editor, a script): the next job of any
                # run naming it would refuse it, so it is written anew, whole, by the same rename.
                os.rename(target, target.parent / f"{_REMOVING}{target.name}.{os.getpid()}")
            self._write(target)
            self._ready = True
            return self.value

    def _write(self, target: Path) -> None:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            # Read-only (what ran is never edited), readable by whom the user's umask lets read runs.
            mask = os.umask(0o022)
            os.umask(mask)
            copy_into(self._files, tmp, file_mode=0o444 & ~mask, exec_mode=0o555 & ~mask, dir_mode=0o755 & ~mask)
            (tmp / LISTING).write_text(self._listing)
            os.chmod(tmp / LISTING, 0o444 & ~mask)
            try:
                os.rename(tmp, target)
                self.created = True
                self._written = target.stat().st_mtime_ns
            except OSError:
                if not target.is_dir():  # not another launch writing the same content first
                    raise
        finally:
            if tmp.exists():
                _remove(tmp)


def _remove(path: Path) -> None:
    """rmtree of a snapshot, whose directories are read-only to others but ours to change."""
    for dirpath, _, _ in os.walk(path):
        with contextlib.suppress(OSError):
            os.chmod(dirpath, 0o700)
    shutil.rmtree(path, ignore_errors=True)


def listing_lines(files: Sequence[SourceFile]) -> str:
    """The snapshot's listing (LISTING): `KIND SHA256 PATH` per entry, sorted by path."""
    return "".join(f"l {hashlib.sha256(f.link.encode()).hexdigest()} {f.dest}\n" if f.link is not None else
                   f"{'x' if f.executable else 'f'} {f.sha256 or file_sha256(f.src)} {f.dest}\n"
                   for f in sorted(files, key=lambda f: f.dest))


def listing_hash(listing: str) -> str:
    return hashlib.sha256(f"{SCHEME}\n{listing}".encode()).hexdigest()


def damage(snapshot_dir: Path, expected: str) -> Optional[str]:
    """How the snapshot at `snapshot_dir` differs from the one whose hash is `expected` (None: it
    is that one, whole): the first file found changed, missing or added. The host's side of what
    every node checks before training (jobs/slurm/verify_lib.sh verify_code)."""
    try:
        listing = (snapshot_dir / LISTING).read_text()
    except OSError:
        return f"{snapshot_dir} has no {LISTING}: it is missing or not a slipway code snapshot"
    if listing_hash(listing) != expected:
        return f"{snapshot_dir / LISTING} is not the listing recorded at submission"
    listed = set()
    for line in listing.splitlines():
        kind, digest, rel = line.split(" ", 2)
        listed.add(rel)
        path = snapshot_dir / rel
        try:
            if kind == "l":
                ok = hashlib.sha256(os.readlink(path).encode()).hexdigest() == digest
            else:
                ok = not path.is_symlink() and file_sha256(path) == digest
        except OSError:
            return f"{path} is missing"
        if not ok:
            return f"{path} differs from the file submitted"
    for dirpath, dirnames, filenames in os.walk(snapshot_dir):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, snapshot_dir)
            if rel != LISTING and rel not in listed and not (_BYTECODE.search(rel) and not os.path.islink(path)):
                return f"{path} was added after submission"
    return None


# The bytecode Python caches beside the sources a rank imports (a snapshot holds none of its own:
# containers/sources.py leaves __pycache__ out), and the file it writes one through (NAME.pyc.ID,
# renamed into place: a rank starting on another node meanwhile): no addition, as verify_code says too.
_BYTECODE = re.compile(r"(?:^|/)__pycache__/[^/]+\.pyc(?:\.[0-9]+)?$")


@contextlib.contextmanager
def store_lock(store: Path, *, exclusive: bool, wait: bool = True) -> Iterator[bool]:
    """flock(2) on STORE/.lock; yields whether held (False: held elsewhere and not `wait`, or no locks)."""
    try:
        fd = os.open(store / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield False
        return
    try:
        yield try_flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB)) is None
    finally:
        os.close(fd)


def prune_store(store: Path, named: set[str]) -> list[tuple[str, int]]:
    """Remove what an interrupted write or pruning left, and the snapshots not in `named` (HASH16)
    that no launch wrote or reused for PRUNE_AFTER_SECONDS; (name, bytes) of each removed. Nothing
    goes where the store cannot be locked (another launch prunes it, or its filesystem has no locks)."""
    now = time.time()
    removed: list[tuple[str, int]] = []
    if not store.is_dir():
        return removed
    with store_lock(store, exclusive=True, wait=False) as held:
        if not held:
            return removed
        for entry in os.scandir(store):
            if not entry.is_dir(follow_symlinks=False) or entry.name in named:
                continue
            if entry.name.startswith("."):  # a write or a pruning cut short (.HASH.*.tmp, .removing-HASH):
                _remove(Path(entry.path))  # no launch writes while this lock is held
                continue
            try:
                if now - entry.stat(follow_symlinks=False).st_mtime < PRUNE_AFTER_SECONDS:
                    continue
            except FileNotFoundError:
                continue
            size = sum(f.stat().st_size for f in Path(entry.path).rglob("*")
                       if f.is_file() and not f.is_symlink() and f.name != LISTING)
            # Gone at once by a rename: nothing ever sees a half-deleted snapshot.
            gone = store / f"{_REMOVING}{entry.name}"
            os.rename(entry.path, gone)
            _remove(gone)
            removed.append((entry.name, size))
    return removed


def plan_snapshot(store: Path, script: Optional[str], project_dir: Optional[Path] = None) -> Snapshot:
    """Hash the code a launch runs (common, trainer and `script`'s folder) by containers/sources.py's rules."""
    source = trainer_source(project_dir)
    # The trainer imports common/ below it: a snapshot carries both, from one place.
    common = source.parent / "common"
    folders = ([Folder(common, "common")] if common.is_dir() else []) + [Folder(source, "trainer")]
    script_dest = None
    if script:
        path = Path(script).resolve()
        folders.append(Folder(path.parent, "script"))
        script_dest = f"script/{path.name}"
    found = collect(folders, field_name="train.script" if script else "code", max_bytes=MAX_BYTES,
                    max_files=MAX_FILES)
    if script_dest and not any(f.dest == script_dest for f in found.files):
        raise ConfigError("train.script", f"{bounded_path(script)} is not tracked by git, while other files of its "
                                          "folder are, and a code snapshot copies tracked files only: `git add` it, "
                                          "or put it in a folder of its own")
    listing = listing_lines(found.files)
    digest = listing_hash(listing)
    where = store / digest[:16]
    git = git_state(source.parent, [f.src for f in folders if f.dest != "script"])
    value = CodeSnapshot(hash=digest, dir=str(where), files=len(found.files), bytes=found.bytes, source=str(source),
                         commit=git["commit"], dirty=git["dirty"], script=str(where / script_dest) if script_dest else None)
    return Snapshot(value, found.files, listing, found.untracked)


PRUNE_EVERY_SECONDS = 3600  # the store keeps what no run names for a day: an hourly pass loses nothing


def prune_code_store(root: Path) -> None:
    """`prune_store` on runs root `root` after a launch recorded its snapshot, at most once in
    PRUNE_EVERY_SECONDS (RUNS/.code.pruned says when), as it reads every manifest; nothing when one
    cannot be read (what it names is then unknown)."""
    stamp = root / f"{STORE}.pruned"
    with contextlib.suppress(OSError, manifests.ManifestError):
        if stamp.exists() and time.time() - stamp.stat().st_mtime < PRUNE_EVERY_SECONDS:
            return
        named = {Path(c.dir).name for path in root.iterdir() if RunDir(path).manifest.is_file()
                 for c in manifests.read(RunDir(path).manifest).snapshots()}
        prune_store(root / STORE, named)
        stamp.touch()
