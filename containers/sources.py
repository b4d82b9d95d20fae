"""The project's own files: exactly what an image's build context and a run's code snapshot take.

Both follow one rule, here (docs/runs.md, docs/secrets.md): in a git checkout the files git tracks,
with their working-tree contents; outside git every file of a project's folder (never a home
directory, a folder holding credentials or more than MAX_LOOSE_FILES files) but hidden files, caches
and editor leftovers. Whatever is not plainly a file of the project's (a link out, a hard link with
names outside, a FIFO, a device, a submodule not checked out, a secret by common/secrets.py, too
much) is refused in one line naming it.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from common.baseline import BASELINE, command, label
from common.errors import ConfigError, bounded_path, human
from common.fs import file_kind, open_regular, user_cache
from common.secrets import file_findings, policy_fingerprint, secret_file
from containers.tools import git

# What is copied is bounded: a data file or a checkpoint left in the code folders is not code.
MAX_FILES = 5000
MAX_BYTES = 100 * 1024 * 1024
MAX_LOOSE_FILES = 1000  # outside git, a folder with more is no project's (a home, a scratch space)
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".ipynb_checkpoints", ".git"}
SKIP_SUFFIXES = (".pyc", ".pyo", ".swp", ".swo", "~", ".orig", ".rej")
# Hidden entries that only a home directory holds: where they are, the folder is no project's.
CREDENTIAL_ENTRIES = {".ssh", ".aws", ".gnupg", ".kube", ".docker", ".azure", ".netrc", ".git-credentials",
                      ".pgpass", ".pypirc", ".npmrc", ".vault-token", ".boto", ".s3cfg"}


@dataclass(frozen=True)
class SourceFile:
    """One entry to copy: `dest` (posix, relative) from `src` (on this machine)."""

    dest: str
    src: Path
    link: Optional[str] = None  # the relative target a symbolic link keeps; None: a file
    sha256: Optional[str] = None  # the content's, as it was scanned

    @property
    def executable(self) -> bool:
        return self.link is None and bool(self.src.stat().st_mode & stat.S_IXUSR)

    @property
    def size(self) -> int:
        return 0 if self.link is not None else self.src.stat().st_size


@dataclass
class Sources:
    """What a walk found: the entries to copy, and the untracked files it left out (a note)."""

    files: list[SourceFile] = field(default_factory=list)
    untracked: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class Folder:
    """A folder to copy: `src` on this machine, `dest` its place in the copy (posix, relative)."""

    src: Path
    dest: str


def _git_list(folder: Path, *, others: bool) -> Optional[list[str]]:
    """Paths (relative to `folder`) that git tracks under it (a checked-out submodule's too), or
    with `others` the untracked, not ignored ones; None where git cannot tell."""
    which = ["--others", "--exclude-standard"] if others else ["--cached", "--recurse-submodules"]
    out = git(folder, "ls-files", "-z", *which, "--", ".")
    return None if out is None else sorted({name for name in out.split("\0") if name})


def _walked(folder: Path, field_name: str) -> list[str]:
    """Every file and link under `folder`, outside git, by the module's rules."""
    with contextlib.suppress(RuntimeError, KeyError, OSError):  # no home to tell
        home = Path.home().resolve()
        if folder == home or folder in home.parents:
            _not_a_project(folder, field_name, "is your home directory (or one above it)")
    names: list[str] = []

    def unreadable(exc: OSError) -> None:
        raise ConfigError(field_name, f"cannot read {bounded_path(exc.filename)} ({exc.strerror}): a code "
                                      "snapshot or image copies every file of the folder: fix its permissions or "
                                      "move it out")

    for dirpath, dirnames, filenames in os.walk(folder, onerror=unreadable):
        dirnames.sort()
        found = CREDENTIAL_ENTRIES.intersection(dirnames + filenames)
        if found:
            _not_a_project(folder, field_name, f"holds credentials ({os.path.join(dirpath, min(found))})")
        dirnames[:] = [d for d in dirnames if not (d in SKIP_DIRS or d.startswith(".") or d.endswith(".egg-info"))]
        # A link to a directory is a link like any other (os.walk does not follow it).
        filenames += [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        names += [os.path.relpath(os.path.join(dirpath, name), folder) for name in sorted(filenames)
                  if not name.startswith(".") and not name.endswith(SKIP_SUFFIXES)]
        if len(names) > MAX_LOOSE_FILES:
            _not_a_project(folder, field_name, f"holds more than {MAX_LOOSE_FILES} files outside git")
    return names


def _not_a_project(folder: Path, field_name: str, why: str) -> None:
    where = ("put the script in a folder of its own (or a git repository) and point train.script at it"
             if field_name == "train.script" else "put the code in a folder of its own or a git checkout")
    raise ConfigError(field_name, f"{bounded_path(folder)} {why}: not a project's folder, and a code snapshot or "
                                  f"image copies the whole folder outside git: {where}")


def _skipped(rel: str) -> bool:
    parts = rel.split("/")
    return any(p in SKIP_DIRS or p.endswith(".egg-info") for p in parts[:-1]) or parts[-1].endswith(SKIP_SUFFIXES)


def _remedy(in_git: bool, shown: str) -> str:
    if in_git:
        return f"leave it out of git (`git rm --cached {shown}`, and list it in .gitignore)"
    return "move it out of that folder"


def collect(folders: Sequence[Folder], *, field_name: str, max_bytes: int, max_files: int) -> Sources:
    """The entries `folders` give, sorted by `dest`, by the module's rules (a one-line ConfigError)."""
    folders = [Folder(f.src.resolve(), f.dest.strip("/")) for f in folders]
    out = Sources()
    origin: dict[str, tuple[bool, Path]] = {}  # dest -> (in git, where its project keeps its baseline)
    for folder in folders:
        top = (git(folder.src, "rev-parse", "--show-toplevel") or "").strip()
        names = _git_list(folder.src, others=False) if top else None
        # A folder of the checkout git knows nothing of (a scratch folder, an installed copy in an
        # ignored .venv): nothing there is the project's by git, so it is walked as outside git.
        untracked = _git_list(folder.src, others=True) if names else None
        in_git = untracked is not None
        root = Path(top).resolve() if in_git else folder.src
        if not in_git:
            names, untracked = _walked(folder.src, field_name), []
        out.untracked += [f"{folder.dest}/{n}" for n in untracked if not _skipped(n)]
        for rel in names:
            if _skipped(rel):
                continue
            entry = _entry(folder, rel, folders, in_git=in_git, field_name=field_name)
            if entry is not None:
                out.files.append(entry)
                origin[entry.dest] = in_git, root
    out.files.sort(key=lambda f: f.dest)
    _check_size(out, field_name, max_bytes, max_files)
    _check_links(out.files, field_name)
    clean = CleanFiles.load()
    out.files = [_scanned(f, field_name, clean, *origin[f.dest]) for f in out.files]
    clean.save()
    return out


def _entry(folder: Folder, rel: str, folders: Sequence[Folder], *, in_git: bool, field_name: str) -> Optional[SourceFile]:
    if "\n" in rel or "\\" in rel:
        raise ConfigError(field_name, f"{bounded_path(folder.src / rel)!r}: a file name holding a newline or a "
                                      "backslash cannot be copied safely: rename it")
    path = folder.src / rel
    dest = f"{folder.dest}/{rel}"
    shown = os.path.relpath(path)
    try:
        st = path.lstat()
    except FileNotFoundError:  # tracked, deleted in the working tree: not part of what runs
        return None
    except OSError as exc:
        raise ConfigError(field_name, f"cannot read {bounded_path(path)} ({exc.strerror}): fix its "
                                      "permissions or move it out") from None
    why = secret_file(path.name)
    if why:
        raise ConfigError(field_name, f"{bounded_path(shown)} looks like a secret ({why}), and a code snapshot "
                                      f"or image would copy it: {_remedy(in_git, shown)}")
    if stat.S_ISLNK(st.st_mode):
        return SourceFile(dest, path, _link_target(path, dest, folders, field_name))
    if stat.S_ISDIR(st.st_mode) and in_git:  # what git lists as one entry and is a directory: a gitlink
        raise ConfigError(field_name, f"{bounded_path(shown)} is a git submodule that is not checked out, or a "
                                      "repository inside this one that git records by its commit alone: a code "
                                      "snapshot or image would leave its files out: check it out (`git submodule "
                                      f"update --init {shown}`), or make its files the project's (`git rm --cached "
                                      f"{shown}`, then add them)")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(field_name, f"{bounded_path(shown)} is {file_kind(st.st_mode)}"
                                      f", not a file, and a code snapshot or image copies files: "
                                      f"{_remedy(in_git, shown)}, or put the file back")
    return SourceFile(dest, path)


def _check_links(files: Sequence[SourceFile], field_name: str) -> None:
    """A file with more names (hard links) than are copied: its other names lie outside what is
    copied, and its content is whatever file they name (a token in $HOME under an innocent name)."""
    stats = {f.dest: f.src.lstat() for f in files if f.link is None}
    names = collections.Counter((st.st_dev, st.st_ino) for st in stats.values())
    for f in files:
        st = stats.get(f.dest)
        if st is not None and st.st_nlink > names[(st.st_dev, st.st_ino)]:
            shown = os.path.relpath(f.src)
            raise ConfigError(field_name, f"{bounded_path(shown)} is a hard link: the same file has "
                                          f"{st.st_nlink} names, some outside what a code snapshot or image copies, "
                                          "so its content is another file's: make it a file of its own "
                                          f"(`cp {shown} {shown}.copy && mv {shown}.copy {shown}`)")


def _scanned(f: SourceFile, field_name: str, clean: "CleanFiles", in_git: bool, top: Path) -> SourceFile:
    """`f` with its content's sha256, scanned whole by the secret policy unless found clean before; what
    the baseline at `top` audited as no secret passes (but is never recorded clean: the baseline may change)."""
    if f.link is not None:
        return f
    try:  # never blocks: a FIFO put in its place since it was listed is no regular file
        fd = os.open(f.src, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as exc:
        raise ConfigError(field_name, f"cannot read {bounded_path(f.src)} ({exc.strerror}): fix its permissions "
                                      "or move it out") from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise ConfigError(field_name, f"{bounded_path(os.path.relpath(f.src))} changed into something that is "
                                          "not a file while it was read: run the command again")
        data = handle.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest not in clean:
        found = [] if f.src.name == BASELINE else file_findings(data, f.src.name)  # a baseline holds hashes
        left = [s for s in found if label(top, f.src, s.secret_hash) is not False]
        if left:
            shown = os.path.relpath(f.src)
            said = f", audited as one in {BASELINE}" if label(top, f.src, left[0].secret_hash) else ""
            raise ConfigError(field_name, f"{bounded_path(shown)} looks like a secret ({left[0].type}, line "
                                          f"{left[0].line_number}{said}), and a code snapshot or image would copy "
                                          f"it: {_remedy(in_git, shown)}; if it is none, record and audit it: "
                                          f"`{command(top, f.src)}`")
        if not found:
            clean.add(digest)
    return SourceFile(f.dest, f.src, None, digest)


class CleanFiles:
    """The sha256 of every content the secret policy found clean, in the user's cache under the policy's
    fingerprint (docs/secrets.md): appended to, never trusted beyond well-formed lines; where it cannot
    be read or written, every file is scanned."""

    _LINE = re.compile(r"[0-9a-f]{64}")
    MAX_BYTES = 8 << 20  # past it the record starts afresh

    def __init__(self, path: Path, known: set[str]):
        self.path, self._known, self._new = path, known, []

    @classmethod
    def load(cls) -> "CleanFiles":
        path = user_cache(f"clean-files-{policy_fingerprint()}")
        try:  # a FIFO or a device in its place is refused by its open, never waited on
            with open_regular(path) or io.BytesIO() as f:
                text = f.read(cls.MAX_BYTES).decode("ascii", "replace")
        except OSError:
            return cls(path, set())
        return cls(path, {line for line in text.split("\n") if cls._LINE.fullmatch(line)})

    def __contains__(self, digest: str) -> bool:
        return digest in self._known

    def add(self, digest: str) -> None:
        self._known.add(digest)
        self._new.append(digest)

    def save(self) -> None:
        if not self._new:
            return
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            big = self.path.exists() and self.path.stat().st_size > self.MAX_BYTES
            # One write of whole lines, appended: two launches adding at once lose nothing.
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | (os.O_TRUNC if big else os.O_APPEND),
                         0o600)
            with os.fdopen(fd, "wb") as f:
                f.write("".join(f"{d}\n" for d in self._new).encode())
        self._new = []


def _link_target(path: Path, dest: str, folders: Sequence[Folder], field_name: str) -> str:
    """The relative target a copied link keeps: where its target lands in the copy (else refused)."""
    target = Path(os.path.realpath(path))
    for folder in folders:
        if target == folder.src or folder.src in target.parents:
            if not target.exists():
                break
            landed = f"{folder.dest}/{target.relative_to(folder.src).as_posix()}".rstrip("/")
            if landed == dest:
                break  # a link to itself (a loop)
            return os.path.relpath(landed, os.path.dirname(dest) or ".")
    raise ConfigError(field_name, f"{bounded_path(os.path.relpath(path))} is a symbolic link to "
                                  f"{bounded_path(os.readlink(path))}, outside what is copied (or to nothing): its "
                                  "target would be copied as if it were the project's: replace the link with the "
                                  "file, or remove it")


def _check_size(found: Sources, field_name: str, max_bytes: int, max_files: int) -> None:
    total = found.bytes
    if total <= max_bytes and len(found.files) <= max_files:
        return
    largest = sorted(found.files, key=lambda f: f.size, reverse=True)[:3]
    named = ", ".join(f"{f.dest} ({human(f.size)})" for f in largest)
    raise ConfigError(field_name, f"the code to copy holds {len(found.files)} files, {human(total)}, more than a "
                                  f"code snapshot or image takes ({max_files} files, {human(max_bytes)}); the "
                                  f"largest: {named}: move data and outputs out of the code folders (or set code.snapshot: false and "
                                  "rebuild the image)")


def copy_into(files: Sequence["SourceFile"], dest: Path, *, file_mode: int, exec_mode: int, dir_mode: int) -> None:
    """Lay `files` out under `dest`, links as links, with the given modes."""
    for f in files:
        target = dest / f.dest
        target.parent.mkdir(parents=True, exist_ok=True)
        if f.link is not None:
            os.symlink(f.link, target)
            continue
        shutil.copyfile(f.src, target)
        os.chmod(target, exec_mode if f.executable else file_mode)
    for dirpath, _, _ in os.walk(dest):
        os.chmod(dirpath, dir_mode)
