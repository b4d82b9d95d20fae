"""Atomic file writes and file digests, shared by every layer (the trainer, the run directory,
the EDF, the image and code snapshots).

A reader sees the old file or the new one, never half of one: write a temp file
beside the target, fsync it, rename it over the target. No torch here.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes, read in 1 MiB chunks (squashfs images are GBs)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_atomic(path: str | os.PathLike, data: str | bytes, mode: int = 0o644) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (a stale lock or temp file's writer)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, someone else's
        return True
    return True
