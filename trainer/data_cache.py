"""The token cache on the shared filesystem: tokenize once, every rank maps it.

One dataset split + one tokenizer = one cache entry in `data.cache_dir`:

    <slug>-<key>.bin          the token ids, flat, documents joined by the EOS id
    <slug>-<key>.json         the index (dtype, n_tokens, vocab size, EOS id, document count,
                              source, who prepared it); present = complete
    <slug>-<key>.bin.partial  an unfinished writer's tokens, and
    <slug>-<key>.progress     how far they go (see `trainer.data_tokenize`)
    <slug>-<key>.lock         held by the one process that writes (pid, host)
    <slug>-<key>.error        why the writer failed, for the ranks waiting on it

The key hashes the dataset's identity (hub name, config and split; or each local file's path,
size and mtime), the text column, the tokenizer's identity and `FORMAT_VERSION`; not the sequence
length: windows are cut when the flat stream is read, so one entry serves every run.

Writers are `slipway prepare` or, when allowed, global rank 0 of the job while the others poll for
the index. The writer touches its lock every `HEARTBEAT_S` seconds; a lock whose heartbeat stopped
for `stale_s` (or whose pid is gone, on the same host) is taken over, its partial file continued.
Waiters give up after `timeout_s` without a live writer, naming the lock. The index is written
last, atomically; and since two writers write the same bytes at the same offsets, even a broken
lock cannot corrupt the cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

from common import environ
from common.errors import ConfigError
from trainer.config import DataSection
from trainer.data_sources import TextSource
from trainer.data_tokenize import (FORMAT_VERSION, TOKEN_DTYPES, CachePaths, ProgressSink, TokenizerSpec, note,
                                   partial_tokens, write_tokens)
from common.fs import NotRegularFile, load_json, pid_alive, read_json, write_atomic

if TYPE_CHECKING:
    import numpy as np

HEARTBEAT_S = 10.0
STALE_S = 180.0  # NFS may cache mtimes for a minute ($SLIPWAY_DATA_STALE_S, read where it is used)
TIMEOUT_S = 1800.0  # $SLIPWAY_DATA_TIMEOUT_S
POLL_S = 1.0


def resolve_cache_dir(data: DataSection, run_dir: Path) -> Path:
    """`data.cache_dir` (`~` and `$VARS` expanded, relative to the working directory), else the
    project's own `<project>/.cache/tokens` (`runs/RUN/../../`), shared by all its runs and
    independent of HF_HOME, which only holds hub downloads; the host finds the same place."""
    if data.cache_dir:
        return Path(os.path.expanduser(os.path.expandvars(data.cache_dir))).resolve()
    return Path(run_dir).resolve().parent.parent / ".cache" / "tokens"


class DataCacheError(RuntimeError):
    """The cache could not be produced or read (not the user's config)."""


@dataclass(frozen=True)
class TokenFile:
    """A complete cache entry, mapped read-only."""

    tokens: np.ndarray  # 1-D memmap
    index: dict[str, Any]
    path: Path
    written: bool = False  # this process tokenized it (else it was there)


def cache_paths(source: TextSource, tokenizer: TokenizerSpec, cache_dir: Path) -> CachePaths:
    blob = json.dumps({"format": FORMAT_VERSION, "source": source.identity, "tokenizer": tokenizer.identity},
                      sort_keys=True)
    key = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return CachePaths(cache_dir, f"{source.slug}-{key}")


def _host() -> str:
    """This host and pid namespace: pids are only comparable within both."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return f"{socket.gethostname()}/{ns}"


def _sweep_tmp(paths: CachePaths) -> None:
    """Remove the temp files killed writers' atomic writes left. Called holding the lock, so none is
    being written (a writer whose lock was wrongly taken over would at worst fail its rename)."""
    for tmp in paths.dir.glob(f".{paths.stem}.*.tmp"):
        with contextlib.suppress(OSError):
            tmp.unlink()


def prepared_by(role: str) -> str:
    """Who writes an entry, for its index and the trainer's log line."""
    job = os.environ.get("SLURM_JOB_ID")
    return f"{role} on {socket.gethostname()}{f' (Slurm job {job})' if job else ''}"


# ---------------------------------------------------------------- the lock


@contextlib.contextmanager
def held(path: Path) -> Iterator[bool]:
    """An O_EXCL lock file at `path`, touched by a heartbeat thread while held: whether we took it."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        yield False
        return
    token, stop = uuid.uuid4().hex, threading.Event()
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), "host": _host(), "token": token, "since": time.time()}, f)

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(path)

    thread = threading.Thread(target=beat, name="slipway-data-lock", daemon=True)
    thread.start()
    try:
        yield True
    finally:
        stop.set()
        thread.join()
        if (read_json(path) or {}).get("token") == token:  # never remove a lock taken over
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


class LockWatch:
    """Judges another process's lock by its heartbeat on *this* clock (nodes' clocks need not agree)."""

    def __init__(self, path: Path, stale_s: float):
        self.path, self.stale_s = path, stale_s
        self._sig: tuple[int, int, int] | None = None
        self._changed = time.monotonic()

    def state(self) -> str:
        """'absent', 'alive', 'stale' (no heartbeat for stale_s) or 'dead' (its pid is gone)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._sig = None
            return "absent"
        sig = (st.st_ino, st.st_mtime_ns, st.st_size)
        if sig != self._sig:
            self._sig, self._changed = sig, time.monotonic()
        if _gone(read_json(self.path) or {}):
            return "dead"
        return "stale" if time.monotonic() - self._changed > self.stale_s else "alive"

    def describe(self) -> str:
        return _holder(read_json(self.path) or {})


def _holder(info: dict[str, Any]) -> str:
    """A lock's writer for a person: "pid N on HOST"."""
    return f"pid {info.get('pid', '?')} on {str(info.get('host', '?')).split('/')[0]}"


# ---------------------------------------------------------------- reading, waiting, writing


def read_index(paths: CachePaths) -> dict[str, Any] | None:
    """The index of a complete entry, checked against its token file's size (no numpy); None when there is none."""
    try:
        index = load_json(paths.index, 1 << 20)
    except (NotRegularFile, ValueError) as exc:
        what = exc.strerror if isinstance(exc, NotRegularFile) else "is not valid JSON"
        raise DataCacheError(f"token cache index {paths.index} {what}: delete it and {paths.bin}, "
                             "then rerun to tokenize again") from None
    if index is None:
        return None
    dtype = index["dtype"]
    if dtype not in TOKEN_DTYPES:
        raise DataCacheError(f"token cache index {paths.index} names dtype {dtype!r}, not one of "
                             f"{', '.join(TOKEN_DTYPES)}: delete it and {paths.bin}, then rerun to tokenize again")
    expected = int(index["n_tokens"]) * TOKEN_DTYPES[dtype]
    size = paths.bin.stat().st_size if paths.bin.exists() else -1
    if size != expected:
        raise DataCacheError(f"token cache {paths.bin} has {size} bytes, its index {paths.index} says {expected}: "
                             "delete both and rerun to tokenize again")
    return index


def open_tokens(paths: CachePaths) -> TokenFile | None:
    """The cache entry if complete, mapped, else None; a damaged one is an error."""
    if (index := read_index(paths)) is None:
        return None
    import numpy as np  # here, not at the top: `entry_status` runs on the login node's base install

    tokens = np.memmap(paths.bin, dtype=np.dtype(index["dtype"]), mode="r", shape=(int(index["n_tokens"]),))
    return TokenFile(tokens, index, paths.bin)


def ensure_tokens(source: TextSource, tokenizer: TokenizerSpec, cache_dir: Path, *, rank: int | None = None,
                  num_proc: int = 0, timeout_s: Optional[float] = None, stale_s: Optional[float] = None,
                  progress: ProgressSink = None, role: str = "rank 0 of the training job") -> TokenFile:
    """The tokenized `source`: from the cache, or written by rank 0 (`role`, for the index) while others wait."""
    rank = (environ.count("RANK") or 0) if rank is None else rank
    timeout_s = environ.seconds("SLIPWAY_DATA_TIMEOUT_S", TIMEOUT_S) if timeout_s is None else timeout_s
    stale_s = environ.seconds("SLIPWAY_DATA_STALE_S", STALE_S) if stale_s is None else stale_s
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("data.cache_dir", f"cannot create '{cache_dir}' ({exc.strerror}); "
                          "set data.cache_dir to a writable shared directory") from None
    paths = cache_paths(source, tokenizer, cache_dir)
    watch = LockWatch(paths.lock, stale_s)
    # The same for every rank of one launch, so waiters only trust its errors.
    ids = [os.environ.get(k, "") for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID")]
    launch = "/".join(ids) if any(ids) else ""
    last_activity = time.monotonic()
    said_waiting = False
    while True:
        if (found := open_tokens(paths)) is not None:
            return found
        if rank == 0:
            with held(paths.lock) as mine:
                if mine:
                    _sweep_tmp(paths)
                    # finished by someone between our look and our lock, else written now
                    return open_tokens(paths) or _write(source, tokenizer, paths, launch, num_proc=num_proc,
                                                        progress=progress, prepared_by=prepared_by(role))
        elif launch:
            _raise_writer_error(paths, launch)
        state = watch.state()
        if state == "alive":
            last_activity = time.monotonic()
            if rank == 0 and not said_waiting:
                note(f"data: waiting for {watch.describe()}, which is writing {paths.bin} "
                     f"({partial_tokens(paths):,} tokens so far)")
                said_waiting = True
        elif state in ("stale", "dead") and rank == 0:
            note(f"data: taking over the {state} token cache lock {paths.lock} ({watch.describe()})")
            with contextlib.suppress(FileNotFoundError):
                paths.lock.unlink()
            continue
        if time.monotonic() - last_activity > timeout_s:
            raise DataCacheError(_timeout_message(paths, state, watch, rank, timeout_s))
        time.sleep(min(POLL_S, stale_s / 4, timeout_s / 4))


def _timeout_message(paths: CachePaths, state: str, watch: LockWatch, rank: int, timeout_s: float) -> str:
    head = f"rank {rank} waited {timeout_s:.0f}s for the token cache index {paths.index}"
    if state == "absent":
        return (f"{head}, but no process holds its lock {paths.lock}: rank 0 never started writing or failed "
                "(see its log); rerun, or check that all ranks see the same data.cache_dir")
    return (f"{head}; its lock {paths.lock} is held by {watch.describe()}, whose heartbeat stopped ({state}): "
            f"if that writer died, delete {paths.lock} and rerun")


def _raise_writer_error(paths: CachePaths, launch: str) -> None:
    if (err := read_json(paths.error)) is None or err.get("launch") != launch:
        return  # none, or from an earlier launch: rank 0 of this one will retry
    if err.get("field"):
        raise ConfigError(err["field"], err["message"])
    raise DataCacheError(f"rank 0 failed to tokenize into {paths.bin}: {err['message']}")


def _write(source: TextSource, tokenizer: TokenizerSpec, paths: CachePaths, launch: str, **kwargs: Any) -> TokenFile:
    with contextlib.suppress(FileNotFoundError):
        paths.error.unlink()
    try:
        index = write_tokens(source, tokenizer, paths, **kwargs)
    except Exception as exc:
        if launch:
            field = exc.field if isinstance(exc, ConfigError) else ""
            message = str(exc).removeprefix(f"{field}: ") if field else f"{type(exc).__name__}: {exc}"
            write_atomic(paths.error, json.dumps({"field": field, "message": message, "launch": launch}))
        raise
    found = open_tokens(paths)
    if found is None or found.index != index:
        raise DataCacheError(f"token cache index {paths.index} vanished or changed right after it was written: "
                             "is another job writing the same data.cache_dir with a different slipway version?")
    return dataclasses.replace(found, written=True)


# --------------------------------------------------- status: is an entry there, without reading or locking anything


@dataclass(frozen=True)
class CacheEntry:
    """One split the run reads, and where its cache entry stands."""

    role: str  # "train" or "validation"
    source: TextSource
    tokenizer: TokenizerSpec
    paths: CachePaths
    index: dict[str, Any] | None  # the index of a complete entry (its tokens there and agreeing), else None
    partial_tokens: int  # tokens an unfinished writer recorded (a rerun continues from there)
    writer: str | None  # "pid N on HOST" while a writer holds the lock
    problem: str | None  # a damaged entry: what is wrong and what to do
    tokenized: bool = False  # this process tokenized it (`slipway prepare`)

    @property
    def prepared(self) -> bool:
        return self.index is not None

    def describe(self) -> str:
        what = f"{self.role} {self.source.description} with {self.tokenizer.description}"
        if self.index is not None:
            return (f"{what}: {'tokenized' if self.tokenized else 'prepared'}, {self.index.get('n_documents', 0):,} "
                    f"documents, {self.index['n_tokens']:,} tokens in {self.paths.bin} (by "
                    f"{self.index.get('prepared_by') or 'an earlier slipway'}, {self.index.get('created', '?')})")
        if self.problem:
            return f"{what}: damaged, {self.problem}"
        state = f"being written by {self.writer}" if self.writer else "not prepared"
        partial = f", {self.partial_tokens:,} tokens written so far" if self.partial_tokens else ""
        return f"{what}: {state}{partial} ({self.paths.bin} missing)"


def entry_status(role: str, source: TextSource, tokenizer: TokenizerSpec, cache_dir: Path) -> CacheEntry:
    paths = cache_paths(source, tokenizer, cache_dir)
    index, problem, writer = None, None, None
    try:
        writer = _live_writer(paths.lock)  # its stat says what a read by fs's rules does not: the folder's state
        index = read_index(paths)
    except (DataCacheError, KeyError, TypeError) as exc:
        problem = str(exc)
    except OSError as exc:  # not a directory, no permission
        raise ConfigError("data.cache_dir", f"cannot read '{cache_dir}' ({exc.strerror}); "
                          "set data.cache_dir to a shared directory this user can write") from None
    return CacheEntry(role, source, tokenizer, paths, index, partial_tokens(paths) if index is None else 0,
                      writer, problem)


def _live_writer(lock: Path) -> str | None:
    """Who holds `lock`, if its pid lives (same host) and it beat within STALE_S
    (by this clock: a snapshot has no time to watch the heartbeat)."""
    info = read_json(lock)
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if info is None or age > environ.seconds("SLIPWAY_DATA_STALE_S", STALE_S):
        return None
    return None if _gone(info) else _holder(info)


def _gone(info: dict[str, Any]) -> bool:
    """Whether a lock's writer was a process of this host that has ended; a pid that names no
    process (damaged, a teammate's tool's) says nothing: its heartbeat decides."""
    pid = info.get("pid")
    return info.get("host") == _host() and type(pid) is int and 0 < pid < 1 << 22 and not pid_alive(pid)
