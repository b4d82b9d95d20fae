"""One launch of a run at a time: a lock on the run, held by whatever launches into it.

`runs/.RUN.lock`, beside the run directory (which may not exist yet), is flock(2)ed by `submit`,
`prepare --as-job` and `slipway local` (the trainer included); every read-modify-write of the
manifest happens under it. The file names the holder (pid, host, since when, the command masked by
the secret policy) for a refusal to show. Only its holder removes it, still locked, when the launch left
no run directory; a waiter then finds it locked a file no longer at that name (`_same_file`). The
lock is per process and re-entrant; a short holder (a submission) is waited for a little, a training
launch (hours) not.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

from common.errors import ConfigError
from common.events import now_iso
from common.fs import file_kind, pid_alive, read_json
from common.secrets import mask

WAIT_SECONDS = 30.0  # how long a launch waits for another's submission to finish before it is refused
POLL_SECONDS = 0.05
# flock(2) on a filesystem without it (Lustre mounted without -o flock): no lock can be had there.
UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


def lock_path(run_dir: Path) -> Path:
    return run_dir.parent / f".{run_dir.name}.lock"


_held: dict[Path, Optional[int]] = {}  # this process's locks: their descriptors (None: no locks on that filesystem)


def holder(run_dir: Path) -> dict:
    """What the lock file says of its holder ({}: nothing readable), meaningful only while held (it keeps the last)."""
    for _ in range(5):  # a holder writes its record just after taking the lock: a moment to finish
        record = read_json(lock_path(run_dir), 64 << 10)  # a record is a line: more is no record of ours
        if record is not None:
            return {} if _gone(record) else record
        time.sleep(POLL_SECONDS)
    return {}


def _gone(record: dict) -> bool:
    """A record of this host whose processes all ended: stale (a teammate's file we may not write keeps it)."""
    if record.get("host") != socket.gethostname():
        return False
    pids = [p for p in (record.get("pid"), record.get("trainer_pid")) if isinstance(p, int) and p > 0]
    return not any(pid_alive(p) for p in pids)


def describe(record: dict) -> str:
    """`slipway local tiny_cpu` (pid 12 on host n1 since 2026-01-01T12:00:00+00:00, trainer pid 13)."""
    if not record:
        return "another process (the lock file does not say which)"
    extra = f", trainer pid {record['trainer_pid']}" if record.get("trainer_pid") else ""
    command = mask(str(record.get("command", "?")), values=True)  # a record written before commands were masked
    return (f"`{command}` (pid {record.get('pid', '?')} on host {record.get('host', '?')} since "
            f"{record.get('since', '?')}{extra})")


def _refusal(run_dir: Path, record: dict) -> ConfigError:
    name = run_dir.name
    if record.get("trains"):
        pid = record.get("pid")
        stop = f"stop it first (kill {pid}), " if pid and record.get("host") == socket.gethostname() else ""
        return ConfigError("run.name", f"run {name} is training: {describe(record)} holds it; wait for it to end, "
                                       f"{stop}or pick another --run-name")
    return ConfigError("run.name", f"run {name} is being launched by {describe(record)}, which still holds it "
                                   f"after {WAIT_SECONDS:g} s: try again once it is done, or pick another --run-name")


def _write_record(fd: int, record: dict) -> None:
    data = (json.dumps(record) + "\n").encode()
    with contextlib.suppress(OSError):  # opened read-only (a teammate's lock file): the lock holds all the same
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)


def _open(path: Path) -> int:
    # O_NONBLOCK: a FIFO in the lock file's place must not hang the open; it is refused below.
    try:  # never writable by others: whoever may write it could swap the record a refusal shows
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    except PermissionError:  # someone else's lock file: flock works on a read-only descriptor
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ConfigError("run.name", f"{path} is {file_kind(mode)}, not the run's lock file: move it aside, then "
                                      "run the command again")
    return fd


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file locked through `fd` (a launch that never was removes its own)."""
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def try_flock(fd: int, flags: int) -> Optional[OSError]:
    """flock(2) on `fd`; None once held, else what kept it: BlockingIOError (another holds it and
    `flags` has LOCK_NB) or the error of a filesystem without locks (UNSUPPORTED). Others raise."""
    try:
        fcntl.flock(fd, flags)
    except OSError as exc:
        if isinstance(exc, BlockingIOError) or exc.errno in UNSUPPORTED:
            return exc
        raise
    return None


def _acquire(run_dir: Path, path: Path) -> Optional[int]:
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        fd = _open(path)
        refused = try_flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if refused is None and _same_file(fd, path):
            return fd
        os.close(fd)
        if isinstance(refused, BlockingIOError):
            record = holder(run_dir)
            if record.get("trains") or time.monotonic() >= deadline:
                raise _refusal(run_dir, record) from None
            time.sleep(POLL_SECONDS)
        elif refused is not None:
            print(f"slipway: note: no lock on run {run_dir.name} ({path.parent} does not support flock: "
                  f"{refused.strerror}): nothing stops a second launch of it meanwhile", file=sys.stderr)
            return None


@contextlib.contextmanager
def hold(run_dir: Path, command: str, *, trains: bool = False) -> Iterator[None]:
    """Hold the lock on the run at `run_dir` for the block, or raise a one-line ConfigError
    naming its holder: at once when the holder trains (`trains`), else after WAIT_SECONDS. A launch
    that leaves no run directory leaves no lock file either, nor the folders made for it."""
    run_dir = Path(run_dir).absolute()
    path = lock_path(run_dir)
    if path in _held:  # held already: the outermost hold lets go
        yield
        return
    made = [d for d in (path.parent, *path.parent.parents) if not d.exists()]  # the innermost first
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = _acquire(run_dir, path)
    except BaseException:
        _remove_empty(made)
        raise
    if fd is not None:
        _write_record(fd, {"pid": os.getpid(), "host": socket.gethostname(), "since": now_iso(),
                           "command": mask(command, values=True), "trains": trains})
    _held[path] = fd
    try:
        yield
    finally:
        del _held[path]
        if fd is not None:
            if not run_dir.exists():  # removed while locked: see _same_file
                with contextlib.suppress(OSError):
                    path.unlink()
                _remove_empty(made)
            # Closed, not unlocked: a trainer handed the descriptor (`held_fd`) keeps the run locked.
            os.close(fd)


def _remove_empty(made: list[Path]) -> None:
    for folder in made:
        with contextlib.suppress(OSError):
            folder.rmdir()  # only if empty


def busy(run_dir: Path) -> Optional[str]:
    """Why a launch of the run would be refused now (another holds its lock), else None; writes nothing."""
    path = lock_path(Path(run_dir).absolute())
    if path in _held:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except OSError as exc:
        refusal = _refusal(Path(run_dir), holder(Path(run_dir)))
        return str(refusal).removeprefix(f"{refusal.field}: ") if isinstance(exc, BlockingIOError) else None
    finally:
        os.close(fd)


def held_fd(run_dir: Path) -> Optional[int]:
    """This process's descriptor of the run's lock (for a child to inherit), None if not held."""
    return _held.get(lock_path(Path(run_dir).absolute()))


def note(run_dir: Path, **fields) -> None:
    """Add `fields` (a trainer's pid) to the record of a lock this process holds."""
    fd = held_fd(run_dir)
    if fd is None:
        return
    record = holder(Path(run_dir))
    if record.get("pid") == os.getpid():
        _write_record(fd, {**record, **fields})
