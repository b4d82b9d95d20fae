"""The code a run runs: a snapshot of the sources, taken at each launch, shared by content.

An image holds dependencies (torch, flash-attn, the base's CUDA); the code the
job runs (the `trainer` package, and a `train.script` with the folder it lives
in) is copied at submit, `slipway local` and `slipway run` into
RUNS/.code/HASH/, one copy per distinct content, and put in front of the image's
baked `trainer` for every runtime: a mount at its own path and PYTHONPATH
(containers), the job's PYTHONPATH (runtime none). PYTHONSAFEPATH keeps the
working directory (the checkout, for runtime none) from shadowing it, and
SLIPWAY_CODE lets the trainer check that it runs from the snapshot at all
(kernel/rundir.py `check_code`). Editing the checkout after a submission
changes nothing for that run, its requeues or its retries: job.sbatch and
env.toml name the snapshot's path, and a snapshot is never written twice.
`code.snapshot: false` runs the image's baked code (sealed production images).

The store keeps what runs name. Each launch that records its code also removes the
snapshots that no run directory's manifest names any more (its run was deleted) and
that no launch has written or reused for PRUNE_AFTER_SECONDS, the grace of a launch
between writing its snapshot and recording it. A lock on the store (shared while a
launch writes or reuses a snapshot, exclusive while one prunes) keeps a pruning from
taking a snapshot that a launch has just chosen.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import time
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

from plumbum import local
from plumbum.commands.processes import ProcessExecutionError

from containers.context import source_files
from kernel.errors import ConfigError, bounded_path
from kernel.fs import file_sha256
from kernel.rundir import CodeSnapshot

STORE = ".code"  # under the runs root: RUNS/.code/HASH16/
SCHEME = "slipway-code-v1"
# A train.script's folder is copied whole: bounded, so a script in $HOME does not copy $HOME.
MAX_SCRIPT_FILES = 2000
MAX_SCRIPT_BYTES = 200 * 1024 * 1024
# A snapshot no manifest names is kept this long after a launch last wrote or reused it: a launch
# records its snapshot only once sbatch has answered, which a busy controller can delay.
PRUNE_AFTER_SECONDS = 24 * 3600
_LOCK = ".lock"
_REMOVING = ".removing-"
# flock(2) on a filesystem without it (Lustre mounted without -o flock).
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


@dataclass(frozen=True)
class _Source:
    dest: str  # path inside the snapshot
    src: Path


def trainer_source(project_dir: Optional[Path] = None) -> Path:
    """The `trainer` package a launch from `project_dir` runs: the checkout's own when slipway runs
    from one (what the user edits, whether slipway is installed editable or not), else the one
    this slipway imports."""
    if project_dir is not None and (project_dir / "trainer" / "__init__.py").is_file():
        return (project_dir / "trainer").resolve()
    import trainer

    return Path(trainer.__file__).resolve().parent


def _walk(root: Path, prefix: str, *, field: str, bounded: bool) -> list[_Source]:
    out: list[_Source] = []
    total = 0
    for path in source_files(root):
        out.append(_Source(f"{prefix}/{path.relative_to(root).as_posix()}", path))
        if bounded:
            total += path.stat().st_size
            if len(out) > MAX_SCRIPT_FILES or total > MAX_SCRIPT_BYTES:
                raise ConfigError(field, f"the script's folder {bounded_path(root)} holds more than "
                                         f"{MAX_SCRIPT_FILES} files or {MAX_SCRIPT_BYTES >> 20} MB, all of which "
                                         "a run's code snapshot copies: put the script in a folder of its own, "
                                         "or set code.snapshot: false")
    return out


def git_state(root: Path, paths: Sequence[Path] = ()) -> dict:
    """The commit of the checkout at `root` and whether it is dirty, or nulls outside git. With
    `paths`, dirty means those paths differ from the commit, untracked files included (a snapshot
    copies them); without, any tracked file of the checkout."""
    git = shutil.which("git")
    if git is None:
        return {"commit": None, "dirty": None}
    try:
        commit = local[git]("-C", str(root), "rev-parse", "HEAD").strip()
        which = ["--", *(os.path.relpath(p, root) for p in paths)] if paths else ["--untracked-files=no"]
        status = local[git]("-C", str(root), "status", "--porcelain", *which).strip()
    except (ProcessExecutionError, ValueError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(status)}


def git_diff(snapshot: CodeSnapshot) -> str:
    """The snapshotted sources' difference from their commit (tracked files; untracked ones named)."""
    source = Path(snapshot.source)
    git = shutil.which("git")
    if git is None or not snapshot.commit:
        return ""
    root = source.parent
    try:
        diff = local[git]("-C", str(root), "diff", "HEAD", "--", os.path.relpath(source, root))
        untracked = local[git]("-C", str(root), "ls-files", "--others", "--exclude-standard", "--",
                               os.path.relpath(source, root)).split()
    except ProcessExecutionError:
        return ""
    return diff + "".join(f"# untracked: {name}\n" for name in untracked)


class Snapshot:
    """A snapshot planned (hashed, nothing written): `value` is what the manifest records,
    `write()` puts it into the store if no run has yet."""

    def __init__(self, value: CodeSnapshot, sources: list[_Source]):
        self.value = value
        self._sources = sources
        self.created = False  # this launch wrote it (a refused submission takes it back)
        self._written = 0  # its mtime then: a later one means another launch reused it

    def discard(self) -> None:
        """Remove the snapshot if this launch wrote it and no other launch has reused it since."""
        if not self.created:
            return
        target = Path(self.value.dir)
        with _store_lock(target.parent, exclusive=True):
            with contextlib.suppress(OSError):
                if target.stat().st_mtime_ns == self._written:
                    shutil.rmtree(target, ignore_errors=True)
                # A store left empty goes too (a refused first submission leaves no trace); with no
                # snapshot in it there is nothing old whose reuse the lock would have to guard.
                if os.listdir(target.parent) == [_LOCK]:
                    os.unlink(target.parent / _LOCK)
                    target.parent.rmdir()

    def write(self) -> CodeSnapshot:
        target = Path(self.value.dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        with _store_lock(target.parent, exclusive=False):
            if target.is_dir():  # content-addressed: the same hash is the same files
                os.utime(target)  # reused now: a pruning leaves it its grace
                return self.value
            return self._write(target)

    def _write(self, target: Path) -> CodeSnapshot:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            for source in self._sources:
                dest = tmp / source.dest
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source.src, dest)
                executable = source.src.stat().st_mode & stat.S_IXUSR
                # Read-only: a snapshot is what ran; nothing edits it in place.
                os.chmod(dest, 0o555 if executable else 0o444)
            for dirpath, _, _ in os.walk(tmp):
                os.chmod(dirpath, 0o755)
            try:
                os.rename(tmp, target)
                self.created = True
                self._written = target.stat().st_mtime_ns
            except OSError:
                if not target.is_dir():  # not another launch writing the same content first
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return self.value


@contextlib.contextmanager
def _store_lock(store: Path, *, exclusive: bool, wait: bool = True) -> Iterator[bool]:
    """flock(2) on STORE/.lock; yields whether it is held (False: another holds it and `wait` is
    off, or the filesystem has no locks)."""
    try:
        fd = os.open(store / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield False
        return
    try:
        flags = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB)
        try:
            fcntl.flock(fd, flags)
        except OSError as exc:
            if exc.errno in _NO_LOCKS or exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                yield False
                return
            raise
        yield True
    finally:
        os.close(fd)


def prune_store(store: Path, named: Iterable[str], *, older_than: float = PRUNE_AFTER_SECONDS,
                now: Optional[float] = None) -> list[tuple[str, int]]:
    """Remove the snapshots of `store` whose directory names (HASH16) are not in `named` and that
    no launch wrote or reused for `older_than` seconds, and what an interrupted write or pruning
    left; (name, bytes) of each snapshot removed. Nothing is removed where the store cannot be
    locked (another launch is pruning it, or its filesystem has no locks)."""
    named = set(named)
    now = time.time() if now is None else now
    removed: list[tuple[str, int]] = []
    if not store.is_dir():
        return removed
    with _store_lock(store, exclusive=True, wait=False) as held:
        if not held:
            return removed
        for entry in os.scandir(store):
            if not entry.is_dir(follow_symlinks=False) or entry.name in named:
                continue
            if entry.name.startswith("."):  # a write or a pruning cut short (.HASH.*.tmp, .removing-HASH):
                shutil.rmtree(entry.path, ignore_errors=True)  # no launch writes while this lock is held
                continue
            try:
                if now - entry.stat(follow_symlinks=False).st_mtime < older_than:
                    continue
            except FileNotFoundError:
                continue
            size = sum(f.stat().st_size for f in Path(entry.path).rglob("*") if f.is_file())
            # Gone at once by a rename: nothing ever sees a half-deleted snapshot.
            gone = store / f"{_REMOVING}{entry.name}"
            os.rename(entry.path, gone)
            shutil.rmtree(gone, ignore_errors=True)
            removed.append((entry.name, size))
    return removed


def plan_snapshot(store: Path, script: Optional[str], project_dir: Optional[Path] = None) -> Snapshot:
    """Hash the code a launch runs: the trainer package, and `script`'s folder (train.script)."""
    source = trainer_source(project_dir)
    # The trainer imports the kernel below it: a snapshot carries both, from one place.
    kernel = source.parent / "kernel"
    sources = _walk(kernel, "kernel", field="code", bounded=False) if kernel.is_dir() else []
    sources += _walk(source, "trainer", field="code", bounded=False)
    script_dest = None
    if script:
        path = Path(script).resolve()
        sources += _walk(path.parent, "script", field="train.script", bounded=True)
        script_dest = f"script/{path.name}"
    h = hashlib.sha256(f"{SCHEME}\n".encode())
    size = 0
    for s in sources:
        mode = "x" if s.src.stat().st_mode & stat.S_IXUSR else "-"
        h.update(f"{s.dest}\0{mode}\0{file_sha256(s.src)}\n".encode())
        size += s.src.stat().st_size
    digest = h.hexdigest()
    where = store / digest[:16]
    git = git_state(source.parent, [source, *([kernel] if kernel.is_dir() else [])])
    value = CodeSnapshot(hash=digest, dir=str(where), files=len(sources), bytes=size, source=str(source),
                         commit=git["commit"], dirty=git["dirty"], script=str(where / script_dest) if script_dest else None)
    return Snapshot(value, sources)
