"""A slow checkpoint directory for tests on the real local Slurm: a FUSE passthrough of a real
directory whose writes are held to a bounded rate (mfusepy over libfuse3). The jobs' processes on
the local cluster's nodes share this machine's mount namespace, so they write through it as they
would to a slow parallel file system; only the writes' pace is changed, never their bytes.

    with SlowDirectory(backing, mountpoint, bytes_per_second=200 << 10):
        ...  # checkpoint.dir=<mountpoint>/ckpt
"""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import time
from pathlib import Path

mfusepy = __import__("pytest").importorskip("mfusepy", reason="mfusepy (the test extra) drives the slow directory")


class _Throttled(mfusepy.Operations):
    """Every call passed to the backing directory; writes paced to `rate` bytes a second, all files
    together (a token bucket without a burst)."""

    use_ns = True

    def __init__(self, root: Path, rate: int):
        self.root, self.rate = str(root), rate
        self._lock, self._next = threading.Lock(), time.monotonic()

    def _path(self, path: str) -> str:
        return self.root + path

    def _pace(self, size: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now) + size / self.rate
            wait = self._next - now
        time.sleep(wait)

    def getattr(self, path, fh=None):
        st = os.lstat(self._path(path)) if fh is None else os.fstat(fh)
        keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime_ns", "st_mtime_ns", "st_ctime_ns")
        out = {k: getattr(st, k) for k in keys}
        for k in ("st_atime", "st_mtime", "st_ctime"):
            out[k] = out.pop(f"{k}_ns")
        return out

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._path(path))]

    def statfs(self, path):
        st = os.statvfs(self._path(path))
        return {k: getattr(st, k) for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                                            "f_ffree", "f_favail", "f_flag", "f_namemax")}

    def access(self, path, amode):
        if not os.access(self._path(path), amode):
            raise mfusepy.FuseOSError(errno.EACCES)
        return 0

    def mkdir(self, path, mode):
        return os.mkdir(self._path(path), mode)

    def rmdir(self, path):
        return os.rmdir(self._path(path))

    def unlink(self, path):
        return os.unlink(self._path(path))

    def rename(self, old, new, flags=0):
        return os.rename(self._path(old), self._path(new))

    def chmod(self, path, mode):
        return os.chmod(self._path(path), mode)

    def chown(self, path, uid, gid):
        return os.chown(self._path(path), uid, gid)

    def utimens(self, path, times=None):
        return os.utime(self._path(path), ns=times) if times else os.utime(self._path(path))

    def truncate(self, path, length, fh=None):
        return os.truncate(fh if fh is not None else self._path(path), length)

    def open(self, path, flags):
        return os.open(self._path(path), flags)

    def create(self, path, mode, fi=None):
        return os.open(self._path(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

    def read(self, path, size, offset, fh):
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        self._pace(len(data))
        return os.pwrite(fh, data, offset)

    def flush(self, path, fh):
        return 0

    def fsync(self, path, datasync, fh):
        return os.fsync(fh)

    def fsyncdir(self, path, datasync, fh):
        return 0

    def release(self, path, fh):
        return os.close(fh)


class SlowDirectory:
    """`mountpoint` shows `backing`, its writes held to `bytes_per_second`, while the block runs."""

    def __init__(self, backing: Path, mountpoint: Path, bytes_per_second: int):
        self.backing, self.mountpoint, self.rate = Path(backing), Path(mountpoint), bytes_per_second
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "SlowDirectory":
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        ops, cwd = _Throttled(self.backing, self.rate), os.getcwd()
        self._thread = threading.Thread(target=mfusepy.FUSE, args=(ops, str(self.mountpoint)),
                                        kwargs={"foreground": True, "nothreads": False}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not os.path.ismount(self.mountpoint):
            assert time.monotonic() < deadline, f"the slow directory did not mount at {self.mountpoint}"
            time.sleep(0.1)
        os.chdir(cwd)  # libfuse moves its process to / as it starts
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=False, capture_output=True)
        if self._thread is not None:
            self._thread.join(timeout=30)
