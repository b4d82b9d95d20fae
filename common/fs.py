"""Atomic file writes (a temp file beside the target, fsynced and renamed over it: a reader sees the
old file or the new one, never half), bounded reads and file digests, for every layer; no torch. A
file others may have made (a team shares a run directory, jobs write it) is opened only when it is
a regular file, judged without blocking (a FIFO would hang an open, a device never ends), and read
with a bound.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pwd
import stat
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Optional


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes, read in 1 MiB chunks (squashfs images are GBs)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_atomic(path: str | os.PathLike, data: str | bytes, mode: int = 0o644, sync: bool = True) -> Path:
    """`sync`: durable before it replaces the old file (not for a cache, which a reader checks)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno is not None:  # said of the file given, not of our temporary one
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise
    return path


def user_cache(name: str) -> Path:
    """File `name` of this user's slipway cache ($XDG_CACHE_HOME or ~/.cache): never needed, rebuilt if unreadable."""
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")) / "slipway" / name


def append_line(path: str | os.PathLike, line: str) -> None:
    """One whole line appended under O_APPEND, never blocked by a FIFO: concurrent writers never interleave in one."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
    try:
        data = (line.rstrip("\n") + "\n").encode()
        written = os.write(fd, data)
        while written < len(data):  # a signal, a full disk
            written += os.write(fd, data[written:])
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in directory `path` durable; a network filesystem that refuses
    fsync on a directory is no error (the rename is atomic all the same)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (a stale lock or temp file's writer)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, someone else's
        return True
    return True


class NotRegularFile(OSError):
    """A path that holds no regular file to read: a FIFO, a device, a socket or a directory."""


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def regular_fd(path: str | os.PathLike) -> Optional[tuple[int, os.stat_result]]:
    """A read descriptor of `path` and its stat when it is a regular file (a link to one followed);
    None where nothing is. Anything else raises NotRegularFile, judged by fstat on an O_NONBLOCK
    descriptor, so that a FIFO never blocks the open. The caller closes it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularFile(errno.EINVAL, f"is {file_kind(st.st_mode)}, not a regular file", os.fspath(path))
    return fd, st


def open_regular(path: str | os.PathLike) -> Optional[BinaryIO]:
    """`path` opened for reading by `regular_fd`'s rules; None where nothing is."""
    found = regular_fd(path)
    if found is None:
        return None
    os.set_blocking(found[0], True)
    return os.fdopen(found[0], "rb")


def file_kind(mode: int) -> str:
    """What a file of st_mode `mode` is, for a message: `a FIFO`, `a directory`..."""
    return next((name for test, name in _KINDS if test(mode)), "a regular file" if stat.S_ISREG(mode) else
                "not a regular file")


def pread_all(fd: int, size: int, offset: int) -> bytes:
    """`size` bytes of regular file `fd` from `offset` (fewer at its end)."""
    data = os.pread(fd, size, offset)
    while 0 < len(data) < size:  # a short read (a signal, a network filesystem): the rest
        more = os.pread(fd, size - len(data), offset + len(data))
        if not more:
            break
        data += more
    return data


def read_file(path: str | os.PathLike, limit: int) -> Optional[tuple[Optional[bytes], os.stat_result]]:
    """(bytes, stat) of `path` by `regular_fd`'s rules, the bytes None where more than `limit`; None
    where there is no file. One open and one fstat: a listing reads ten thousand of them."""
    found = regular_fd(path)
    if found is None:
        return None
    fd, st = found
    try:
        if st.st_size > limit:
            return None, st
        data = pread_all(fd, st.st_size + 1, 0)
        if len(data) > st.st_size:  # it grew as it was read: the rest too, within the bound
            data += pread_all(fd, limit + 1 - len(data), len(data))
    finally:
        os.close(fd)
    return (None if len(data) > limit else data), st


def existing_parent(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (where it would be made)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def load_json(path: str | os.PathLike, limit: int = 64 << 20) -> Any:
    """The JSON `path` holds, by `read_file`'s rules (None: no file): NotRegularFile at once for anything
    but a regular file (a FIFO never blocks), ValueError where damaged or larger than `limit`."""
    found = read_file(path, limit)
    return None if found is None else json.loads(found[0] or b"")


def read_json(path: str | os.PathLike, limit: int = 64 << 20) -> Optional[dict[str, Any]]:
    """The JSON object a state file of ours holds, by `load_json`; None where it is missing, unreadable,
    larger than `limit` or damaged (anything but an object): "none" to each reader."""
    try:
        data = load_json(path, limit)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_tail(path: str | os.PathLike, limit: int) -> Optional[bytes]:
    """At most the last `limit` bytes of `path` (`regular_fd`'s rules), from a line's start; None if no file."""
    found = regular_fd(path)
    if found is None:
        return None
    fd, st = found
    try:
        size = st.st_size
        data = pread_all(fd, min(size, limit), max(0, size - limit))
    finally:
        os.close(fd)
    if size > limit:  # the first line is cut: drop it
        data = data[data.find(b"\n") + 1:] if b"\n" in data else b""
    return data


def closed_by(path: str | os.PathLike) -> Optional[tuple[Path, str]]:
    """The first folder on the way to `path`, or `path` itself, that this user may not enter or
    read, with its `ownership`: what a "Permission denied" is about (None where none is found)."""
    path = Path(os.path.abspath(path))
    for step in [*reversed(path.parents), path]:
        try:
            closed = not os.access(step, os.X_OK | os.R_OK if step.is_dir() else os.R_OK)
        except OSError:
            return None
        if closed:
            return step, ownership(step)
    return None


def ownership(path: str | os.PathLike) -> str:
    """`owned by NAME, mode 0700`, for a message about a path closed to this user ('' where unknown)."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    try:
        name = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        name = f"uid {st.st_uid}"
    return f"owned by {name}, mode {stat.S_IMODE(st.st_mode):04o}"
