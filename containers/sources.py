"""The project's own files: exactly what an image's build context and a run's code snapshot take.

Both copy folders of the checkout (the code snapshot: common/ and trainer/, and a
train.script's folder; the image: those and jobs/, edf/, containers/, configs/) to where
they run, so both follow one rule, here:

- In a git checkout, the files git tracks under each folder, with their working-tree
  contents: what the project is, not what else lies around (an untracked credentials.json,
  a scratch copy of a dataset). Untracked files are named in a note, never copied.
- Outside git (an installed slipway, a script folder elsewhere, a folder of the checkout
  where git tracks nothing), every file of the folder but hidden files, caches and editor
  leftovers.
- A symbolic link is kept, as a link, only when it points inside what is copied (it is
  rewritten relative, so that it points at the copy); one pointing anywhere else (a token
  file in $HOME, /proc/self/environ) is refused in one line naming it: its target would be
  copied as if it were the project's.
- A file that looks like a secret (a private key, a credentials or token file, .netrc, an
  env file) is refused in one line naming it and how to leave it out.
- What is copied is bounded: past `max_bytes` or `max_files` the refusal names the
  largest files.
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from plumbum import local
from plumbum.commands.processes import ProcessExecutionError

from common.errors import ConfigError, bounded_path
from common.secrets import HEAD_BYTES, secret_file

# What is copied is bounded: a data file or a checkpoint left in the code folders is not code.
MAX_FILES = 5000
MAX_BYTES = 100 * 1024 * 1024
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".ipynb_checkpoints", ".git"}
SKIP_SUFFIXES = (".pyc", ".pyo", ".swp", ".swo", "~", ".orig", ".rej")

@dataclass(frozen=True)
class SourceFile:
    """One entry to copy: `dest` (where it goes, posix, relative), `src` (on this machine), and
    `link`: the relative target a symbolic link keeps (None for a file)."""

    dest: str
    src: Path
    link: Optional[str] = None

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


def _git_root(path: Path) -> Optional[Path]:
    git = shutil.which("git")
    if git is None:
        return None
    try:
        top = local[git]("-C", str(path), "rev-parse", "--show-toplevel").strip()
    except (ProcessExecutionError, OSError):
        return None
    return Path(top).resolve() if top else None


def _git_list(root: Path, folder: Path, *, others: bool) -> list[str]:
    """Paths (relative to `folder`) that git tracks under it, or with `others` the untracked,
    not ignored ones."""
    which = ["--others", "--exclude-standard"] if others else ["--cached"]
    out = local["git"]("-C", str(folder), "ls-files", "-z", *which, "--", ".")
    return sorted({name for name in out.split("\0") if name})


def _walked(folder: Path, field_name: str) -> list[str]:
    """Every file and link under `folder` outside git, hidden ones, caches and leftovers aside."""
    names: list[str] = []

    def unreadable(exc: OSError) -> None:
        raise ConfigError(field_name, f"cannot read {bounded_path(exc.filename)} ({exc.strerror}): a code "
                                      "snapshot or image copies every file of the folder: fix its permissions or "
                                      "move it out")

    for dirpath, dirnames, filenames in os.walk(folder, onerror=unreadable):
        dirnames.sort()
        keep = []
        for d in dirnames:
            if d in SKIP_DIRS or d.startswith(".") or d.endswith(".egg-info"):
                continue
            if os.path.islink(os.path.join(dirpath, d)):
                filenames.append(d)  # a link to a directory is a link like any other
            else:
                keep.append(d)
        dirnames[:] = keep
        for name in sorted(filenames):
            if name.startswith(".") or name.endswith(SKIP_SUFFIXES):
                continue
            names.append(os.path.relpath(os.path.join(dirpath, name), folder))
    return names


def _skipped(rel: str) -> bool:
    parts = rel.split("/")
    return any(p in SKIP_DIRS or p.endswith(".egg-info") for p in parts[:-1]) or parts[-1].endswith(SKIP_SUFFIXES)


def _remedy(in_git: bool, shown: str) -> str:
    if in_git:
        return f"leave it out of git (`git rm --cached {shown}`, and list it in .gitignore)"
    return "move it out of that folder"


def collect(folders: Sequence[Folder], *, field_name: str, max_bytes: int, max_files: int) -> Sources:
    """The entries `folders` give, in a stable order (see the module's rules); a one-line
    ConfigError for a link out, a secret-looking file, an unreadable one, or too much."""
    folders = [Folder(f.src.resolve(), f.dest.strip("/")) for f in folders]
    out = Sources()
    for folder in folders:
        root = _git_root(folder.src)
        in_git = root is not None
        if in_git:
            try:
                names = _git_list(root, folder.src, others=False)
                untracked = _git_list(root, folder.src, others=True)
            except (ProcessExecutionError, OSError):
                in_git, names, untracked = False, [], []
            # A folder of the checkout git knows nothing of (a scratch folder, an installed copy in
            # an ignored .venv): nothing there is the project's by git, so it is walked as outside git.
            in_git = in_git and bool(names)
        if not in_git:
            names, untracked = _walked(folder.src, field_name), []
        out.untracked += [f"{folder.dest}/{n}" for n in untracked if not _skipped(n)]
        for rel in names:
            if _skipped(rel):
                continue
            entry = _entry(folder, rel, folders, in_git=in_git, field_name=field_name)
            if entry is not None:
                out.files.append(entry)
    out.files.sort(key=lambda f: f.dest)
    _check_size(out, field_name, max_bytes, max_files)
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
    if stat.S_ISLNK(st.st_mode):
        if why:
            raise ConfigError(field_name, f"{bounded_path(shown)} looks like a secret ({why}), and a code snapshot "
                                          f"or image would copy it: {_remedy(in_git, shown)}")
        return SourceFile(dest, path, _link_target(path, dest, folders, field_name))
    if not stat.S_ISREG(st.st_mode):
        return None  # a socket, a fifo: nothing to copy
    try:
        with open(path, "rb") as f:
            head = f.read(HEAD_BYTES)
    except OSError as exc:
        raise ConfigError(field_name, f"cannot read {bounded_path(path)} ({exc.strerror}): fix its permissions "
                                      "or move it out") from None
    why = why or secret_file("", head)
    if why:
        raise ConfigError(field_name, f"{bounded_path(shown)} looks like a secret ({why}), and a code snapshot or "
                                      f"image would copy it: {_remedy(in_git, shown)}")
    return SourceFile(dest, path)


def _link_target(path: Path, dest: str, folders: Sequence[Folder], field_name: str) -> str:
    """The relative target a copied link keeps: where its target lands in the copy. A link to
    anything not copied (outside every folder, or nowhere) is refused."""
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
    named = ", ".join(f"{f.dest} ({_human(f.size)})" for f in largest)
    raise ConfigError(field_name, f"the code to copy holds {len(found.files)} files, {_human(total)}, more than a "
                                  f"code snapshot or image takes ({max_files} files, {_human(max_bytes)}); the "
                                  f"largest: {named}: move data and outputs out of the code folders (or set code.snapshot: false and "
                                  "rebuild the image)")


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def copy_into(files: Sequence["SourceFile"], dest: Path, *, file_mode: int, exec_mode: int, dir_mode: int) -> None:
    """Lay `files` (SourceFile or ContextFile: `dest`, `src`, `link`) out under `dest`, links as
    links, with the given modes."""
    for f in files:
        target = dest / f.dest
        target.parent.mkdir(parents=True, exist_ok=True)
        if f.link is not None:
            os.symlink(f.link, target)
            continue
        shutil.copyfile(f.src, target)
        os.chmod(target, exec_mode if os.stat(f.src).st_mode & stat.S_IXUSR else file_mode)
    for dirpath, _, _ in os.walk(dest):
        os.chmod(dirpath, dir_mode)
