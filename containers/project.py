"""Which project an image, an import or a kept container belongs to, and which builds run now
(docs/image.md#whose-images-a-project).

Each checkout has an identity of its own, a random id in `ROOT/.slipway/project` (never
committed: two clones are two projects), not its path: a checkout that moves keeps it, a copy
(whose file names a place that still holds the id) gets a new one at its first use. A read-only
checkout keeps it in `$XDG_STATE_HOME/slipway/projects/` under a hash of its path. A build or
import holds a shared flock(2) on `.slipway/locks/TAG.lock` from before it looks at podman until
its import's leftovers are gone: prune asks for the lock, it does not guess from temp files.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from common.errors import ConfigError
from common.fs import read_json, write_atomic

STATE_DIR = ".slipway"
LABEL = "slipway.project"  # the project's id, on every image slipway builds
PATH_LABEL = "slipway.project.path"  # where it was, for messages only (a checkout may move)
_ID = re.compile(r"[0-9a-f]{32}")
# flock(2) on a filesystem without it (Lustre mounted without -o flock).
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


@dataclass(frozen=True)
class Project:
    id: str  # 32 hex digits
    root: Path
    state: Path  # where its id and locks are kept: ROOT/.slipway, or the user's (a read-only checkout)

    @property
    def token(self) -> str:
        """What names carry: `p` and 12 hex digits (never a job id or a build's: those start with a digit or `i`)."""
        return f"p{self.id[:12]}"

    @property
    def labels(self) -> dict[str, str]:
        return {LABEL: self.id, PATH_LABEL: str(self.root)}

    @property
    def file(self) -> Path:
        return self.state / "project"

    @classmethod
    def of(cls, root: Path) -> "Project":
        """The project of checkout `root`: its recorded id, made on first use, kept by a move, new for a copy."""
        root = Path(os.path.abspath(root))
        xdg = os.environ.get("XDG_STATE_HOME", "")  # empty or relative: unset, as the XDG spec says
        user = (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "state") / "slipway" / "projects"
        tried = []
        for state in (root / STATE_DIR, user / hashlib.sha256(str(root).encode()).hexdigest()[:16]):
            try:
                state.mkdir(parents=state.name != STATE_DIR, exist_ok=True)
                # Without flock, two first uses at once may make two ids: the last one written stays.
                with _held(state / "project.lock", fcntl.LOCK_EX):
                    return cls._read_or_make(root, state)
            except OSError as exc:
                tried.append(f"{state / 'project'}: {exc.strerror or exc}")
        raise ConfigError("image", f"cannot record this project's identity ({'; '.join(tried)}): slipway labels "
                                   "the images it builds with it; make the checkout or XDG_STATE_HOME writable")

    @classmethod
    def _read_or_make(cls, root: Path, state: Path) -> "Project":
        path = state / "project"
        data = read_json(path)  # none, or damaged: a new id (the images labelled with the old one stay, another project's)
        if isinstance(data, dict) and isinstance(data.get("id"), str) and _ID.fullmatch(data["id"]):
            made_at = Path(str(data.get("root", "")))
            if made_at == root:
                return cls(data["id"], root, state)
            if not _is_copy_of(path, made_at / STATE_DIR / "project", data["id"]):
                write_atomic(path, json.dumps({"id": data["id"], "root": str(root)}) + "\n")  # moved
                return cls(data["id"], root, state)
        project = cls(secrets.token_hex(16), root, state)
        write_atomic(path, json.dumps({"id": project.id, "root": str(root)}) + "\n")
        return project

    # ------------------------------------------------------------ builds running now

    def lock_path(self, tag: str) -> Path:
        return self.state / "locks" / (re.sub(r"[^A-Za-z0-9_.-]", "_", tag.rsplit("/", 1)[-1]) + ".lock")

    def building(self, tag: str) -> contextlib.AbstractContextManager[Optional[bool]]:
        """Hold `tag`'s lock (shared: two builds of one tag may run) for the block; yields None
        where the filesystem has no flock (nothing then tells prune that this build runs)."""
        return _held(self.lock_path(tag), fcntl.LOCK_SH)

    def idle(self, tag: str) -> contextlib.AbstractContextManager[Optional[bool]]:
        """Whether no build or import of `tag` runs (True), one does (False), or it cannot be told
        (None: no flock here); while True, none can start until the block ends."""
        return _held(self.lock_path(tag), fcntl.LOCK_EX | fcntl.LOCK_NB)

    def forget(self, tag: str) -> None:
        """Remove the lock file of a tag that is gone (only inside `idle`: a build that opened the
        old file finds it replaced and locks the new one)."""
        self.lock_path(tag).unlink(missing_ok=True)


class _NoFlock(OSError):
    pass


def _lock(path: Path, how: int) -> int:
    """An open descriptor of `path` locked `how`; raises BlockingIOError (LOCK_NB, held) or
    _NoFlock. Locks the file the path names when it returns, even if it was replaced meanwhile."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, how)
        except OSError as exc:
            os.close(fd)
            if exc.errno in _NO_FLOCK:
                raise _NoFlock(exc.errno, exc.strerror) from None
            raise
        with contextlib.suppress(FileNotFoundError):
            here, there = os.fstat(fd), os.stat(path)
            if (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino):
                return fd
        os.close(fd)  # removed (`forget`) while we waited: lock the file now at that path


@contextlib.contextmanager
def _held(path: Path, how: int) -> Iterator[Optional[bool]]:
    """`path` locked `how` for the block: True, False (LOCK_NB: another holds it), None (no flock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = None
    try:
        fd = _lock(path, how)
        state: Optional[bool] = True
    except BlockingIOError:
        state = False
    except _NoFlock:
        state = None
    try:
        yield state
    finally:
        if fd is not None:
            os.close(fd)


def _is_copy_of(mine: Path, original: Path, project_id: str) -> bool:
    """Whether the id file at `mine` is a copy of `original`'s: that file still exists, is another file
    than ours (not the same checkout seen through a link or a bind mount), and holds the same id."""
    try:
        return not os.path.samefile(mine, original) and (read_json(original) or {}).get("id") == project_id
    except OSError:
        return False
