"""The code a run runs: a snapshot of the sources, taken at each launch, shared by content.

An image holds dependencies (torch, flash-attn, the base's CUDA); the code the
job runs (the `trainer` package, and a `train.script` with the folder it lives
in) is copied at submit, `slipway local` and `slipway run` into
RUNS/.code/HASH/, one copy per distinct content, and put in front of the image's
baked `trainer` for every runtime: a mount at its own path and PYTHONPATH
(containers), the job's PYTHONPATH (runtime none). PYTHONSAFEPATH keeps the
working directory (the checkout, for runtime none) from shadowing it, and
SLIPWAY_CODE lets the trainer check that it runs from the snapshot at all
(trainer/rundir.py `check_code`). Editing the checkout after a submission
changes nothing for that run, its requeues or its retries: job.sbatch and
env.toml name the snapshot's path, and a snapshot is never written twice.
`code.snapshot: false` runs the image's baked code (sealed production images).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from plumbum import local
from plumbum.commands.processes import ProcessExecutionError

from containers.context import source_files
from trainer.config import ConfigError, bounded_path
from trainer.fs import file_sha256
from trainer.rundir import CodeSnapshot

STORE = ".code"  # under the runs root: RUNS/.code/HASH16/
SCHEME = "slipway-code-v1"
# A train.script's folder is copied whole: bounded, so a script in $HOME does not copy $HOME.
MAX_SCRIPT_FILES = 2000
MAX_SCRIPT_BYTES = 200 * 1024 * 1024


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

    def discard(self) -> None:
        """Remove the snapshot if this launch wrote it, and the store if that leaves it empty."""
        if not self.created:
            return
        shutil.rmtree(self.value.dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            Path(self.value.dir).parent.rmdir()

    def write(self) -> CodeSnapshot:
        target = Path(self.value.dir)
        if target.is_dir():
            return self.value  # content-addressed: the same hash is the same files
        target.parent.mkdir(parents=True, exist_ok=True)
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
            except OSError:
                if not target.is_dir():  # not another launch writing the same content first
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return self.value


def plan_snapshot(store: Path, script: Optional[str], project_dir: Optional[Path] = None) -> Snapshot:
    """Hash the code a launch runs: the trainer package, and `script`'s folder (train.script)."""
    source = trainer_source(project_dir)
    sources = _walk(source, "trainer", field="code", bounded=False)
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
    git = git_state(source.parent, [source])
    value = CodeSnapshot(hash=digest, dir=str(where), files=len(sources), bytes=size, source=str(source),
                         commit=git["commit"], dirty=git["dirty"], script=str(where / script_dest) if script_dest else None)
    return Snapshot(value, sources)
