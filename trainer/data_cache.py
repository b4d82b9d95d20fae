"""The token cache on the shared filesystem: tokenize once, every rank maps it.

One dataset split + one tokenizer = one cache entry in `data.cache_dir`:

    <slug>-<key>.bin     the token ids, documents joined by the EOS id (uint16
                         when the vocabulary fits, else uint32), flat
    <slug>-<key>.json    the index: dtype, n_tokens, vocab size, EOS id,
                         document count, the source; present = complete
    <slug>-<key>.lock    held by the one process that writes (pid, host)
    <slug>-<key>.error   why the writer failed, for the ranks waiting on it

The key hashes the dataset's identity (hub name, config and split; or each
local file's path, size and mtime), the text column, the tokenizer's
identity (hub name, or the sha256 of its file) and `FORMAT_VERSION`. The
sequence length is not part of it: the cache is a flat stream and windows
are cut when it is read, so one cache serves every `data.seq_len`.

Only global rank 0 (env `RANK`, default 0) writes; the others poll for the
index. The writer touches its lock every `HEARTBEAT_S` seconds; a lock
whose heartbeat stopped for `stale_s` (or whose pid is gone, on the same
host) is stale, and rank 0 takes it over. Waiters give up after `timeout_s`
without a live writer, naming the lock. Both files are written to a
temporary name in the same directory, fsynced and renamed into place, the
index last, so a crash never leaves an index that points at partial data;
and since two writers would write the same bytes, even a broken lock cannot
corrupt the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.config import ConfigError
from trainer.data_sources import TextSource, TokenizerSpec, eos_id, load_tokenizer
from trainer.fs import pid_alive, write_atomic

FORMAT_VERSION = 1
HEARTBEAT_S = 10.0
STALE_S = float(os.environ.get("SLIPWAY_DATA_STALE_S", 180))  # NFS may cache mtimes for a minute
TIMEOUT_S = float(os.environ.get("SLIPWAY_DATA_TIMEOUT_S", 1800))
POLL_S = 1.0


class DataCacheError(RuntimeError):
    """The cache could not be produced or read (not the user's config)."""


@dataclass(frozen=True)
class TokenFile:
    """A complete cache entry, mapped read-only."""

    tokens: np.ndarray  # 1-D memmap
    index: dict[str, Any]
    path: Path

    @property
    def vocab_size(self) -> int:
        return int(self.index["vocab_size"])


@dataclass(frozen=True)
class CachePaths:
    dir: Path
    stem: str

    def _p(self, suffix: str) -> Path:
        return self.dir / f"{self.stem}{suffix}"

    bin = property(lambda self: self._p(".bin"))
    index = property(lambda self: self._p(".json"))
    lock = property(lambda self: self._p(".lock"))
    error = property(lambda self: self._p(".error"))


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


def _launch_id() -> str:
    """The same for every rank of one launch, so waiters only trust its errors."""
    ids = [os.environ.get(k, "") for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID")]
    return "/".join(ids) if any(ids) else ""


def _host_tag() -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname())


def _tmp_name(path: Path) -> Path:
    """A temporary name beside `path` that says who writes it: NAME.tmp.HOST.PID.RANDOM."""
    return path.with_name(f"{path.name}.tmp.{_host_tag()}.{os.getpid()}.{uuid.uuid4().hex[:8]}")


def _sweep_tmp(paths: CachePaths) -> None:
    """Remove what killed writers left: their pid is gone on this host, or it is a day old."""
    for tmp in [*paths.dir.glob(f"{paths.stem}.*.tmp.*"), *paths.dir.glob(f".{paths.stem}.*.tmp")]:
        _, host, pid, _ = (tmp.name.rsplit(".", 3) + ["", "", "", ""])[:4]
        with contextlib.suppress(OSError):
            dead = host == _host_tag() and pid.isdigit() and not pid_alive(int(pid))
            if dead or time.time() - tmp.stat().st_mtime > 86400:
                tmp.unlink()


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------
# The lock
# --------------------------------------------------------------------------


class Lock:
    """An O_EXCL lock file with a heartbeat thread that touches it."""

    def __init__(self, path: Path):
        self.path = path
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        info = {"pid": os.getpid(), "host": _host(), "token": self.token, "since": time.time()}
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
        self._thread = threading.Thread(target=self._beat, name="slipway-data-lock", daemon=True)
        self._thread.start()
        return True

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if (read_lock(self.path) or {}).get("token") == self.token:  # never remove a lock taken over
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def read_lock(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class LockWatch:
    """Judges another process's lock by its heartbeat as seen on *this* clock
    (clocks of different nodes need not agree), and by its pid on this host."""

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
        info = read_lock(self.path)
        if info and info.get("host") == _host() and not pid_alive(int(info.get("pid", -1))):
            return "dead"
        return "stale" if time.monotonic() - self._changed > self.stale_s else "alive"

    def describe(self) -> str:
        info = read_lock(self.path) or {}
        return f"pid {info.get('pid', '?')} on {str(info.get('host', '?')).split('/')[0]}"


# --------------------------------------------------------------------------
# Reading, waiting, writing
# --------------------------------------------------------------------------


def open_tokens(paths: CachePaths) -> TokenFile | None:
    """The cache entry if complete, else None; a damaged one is an error."""
    try:
        index = json.loads(paths.index.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        raise DataCacheError(f"token cache index {paths.index} is not valid JSON: delete it and {paths.bin}, "
                             "then rerun to tokenize again") from None
    dtype = np.dtype(index["dtype"])
    expected = int(index["n_tokens"]) * dtype.itemsize
    size = paths.bin.stat().st_size if paths.bin.exists() else -1
    if size != expected:
        raise DataCacheError(f"token cache {paths.bin} has {size} bytes, its index {paths.index} says {expected}: "
                             "delete both and rerun to tokenize again")
    tokens = np.memmap(paths.bin, dtype=dtype, mode="r", shape=(int(index["n_tokens"]),))
    return TokenFile(tokens, index, paths.bin)


def ensure_tokens(source: TextSource, tokenizer: TokenizerSpec, cache_dir: Path, *, rank: int | None = None,
                  num_proc: int = 0, timeout_s: float = TIMEOUT_S, stale_s: float = STALE_S) -> TokenFile:
    """The tokenized `source`: read from the cache, or written by rank 0 while the others wait."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("data.cache_dir", f"cannot create '{cache_dir}' ({exc.strerror}); "
                          "set data.cache_dir to a writable shared directory") from None
    paths = cache_paths(source, tokenizer, cache_dir)
    watch = LockWatch(paths.lock, stale_s)
    launch = _launch_id()
    last_activity = time.monotonic()
    while True:
        found = open_tokens(paths)
        if found is not None:
            return found
        if rank == 0:
            lock = Lock(paths.lock)
            if lock.acquire():
                try:
                    _sweep_tmp(paths)
                    found = open_tokens(paths)  # finished by someone between our look and our lock
                    return found if found is not None else _write(source, tokenizer, paths, num_proc, launch)
                finally:
                    lock.release()
        elif launch:
            _raise_writer_error(paths, launch)
        state = watch.state()
        if state == "alive":
            last_activity = time.monotonic()
        elif state in ("stale", "dead") and rank == 0:
            _log(f"data: taking over the {state} token cache lock {paths.lock} ({watch.describe()})")
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
    try:
        err = json.loads(paths.error.read_text())
    except (OSError, ValueError):
        return
    if err.get("launch") != launch:
        return  # from an earlier launch: rank 0 of this one will retry
    if err.get("field"):
        raise ConfigError(err["field"], err["message"])
    raise DataCacheError(f"rank 0 failed to tokenize into {paths.bin}: {err['message']}")


def _write(source: TextSource, tokenizer: TokenizerSpec, paths: CachePaths, num_proc: int, launch: str) -> TokenFile:
    with contextlib.suppress(FileNotFoundError):
        paths.error.unlink()
    try:
        index = write_tokens(source, tokenizer, paths, num_proc)
    except BaseException as exc:
        if launch and isinstance(exc, Exception):
            field = exc.field if isinstance(exc, ConfigError) else ""
            message = str(exc).removeprefix(f"{field}: ") if field else f"{type(exc).__name__}: {exc}"
            write_atomic(paths.error, json.dumps({"field": field, "message": message, "launch": launch}))
        raise
    found = open_tokens(paths)
    if found is None or found.index != index:
        raise DataCacheError(f"token cache index {paths.index} vanished or changed right after it was written: "
                             "is another job writing the same data.cache_dir with a different slipway version?")
    return found


def write_tokens(source: TextSource, tokenizer: TokenizerSpec, paths: CachePaths, num_proc: int = 0) -> dict:
    """Tokenize `source` into `paths.bin` and `paths.index`, atomically. Returns the index."""
    threads = num_proc or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()) or 1
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))  # tokenizers' pool, before its first use
    tok = load_tokenizer(tokenizer)
    eos = eos_id(tok, tokenizer.spec)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    tmp = _tmp_name(paths.bin)
    _log(f"data: tokenizing {source.description} with {tokenizer.description} ({threads} threads) -> {paths.bin}")
    n_tokens = n_docs = n_chars = 0
    start = time.perf_counter()
    try:
        with open(tmp, "wb") as f, _progress(source) as advance:
            for texts, units in source.batches():
                if texts:
                    ids = [e.ids for e in encode(texts, add_special_tokens=False)]
                    count = sum(map(len, ids)) + len(ids)
                    flat = itertools.chain.from_iterable(itertools.chain(x, (eos,)) for x in ids)
                    f.write(np.fromiter(flat, dtype=dtype, count=count).tobytes())
                    n_tokens, n_docs, n_chars = n_tokens + count, n_docs + len(texts), n_chars + sum(map(len, texts))
                advance(units, n_tokens)
            f.flush()
            os.fsync(f.fileno())
        if n_tokens == 0:
            raise ConfigError(source.field, f"{source.description} holds no text in column '{source.column}'")
        os.replace(tmp, paths.bin)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    seconds = time.perf_counter() - start
    index = {"format": FORMAT_VERSION, "dtype": dtype.name, "n_tokens": n_tokens, "vocab_size": vocab,
             "eos_id": eos, "n_documents": n_docs, "n_chars": n_chars, "source": source.description,
             "tokenizer": tokenizer.description, "inputs": {"source": source.identity,
                                                          "tokenizer": tokenizer.identity},
             "seconds": round(seconds, 3), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_atomic(paths.index, json.dumps(index, indent=1))
    _fsync_dir(paths.dir)
    _log(f"data: tokenized {source.description}: {n_docs:,} documents, {n_tokens:,} tokens in {seconds:.1f}s "
         f"({n_chars / max(seconds, 1e-9) / 1e6:.1f} M chars/s) -> {paths.bin}")
    return index


# --------------------------------------------------------------------------
# Progress: a rich bar on a terminal, a line every 30 s in a Slurm log
# --------------------------------------------------------------------------


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _bar_library() -> str:
    """'rich' or 'tqdm' when stderr is a terminal and one is installed, else '' (plain log lines)."""
    if not sys.stderr.isatty():
        return ""
    for name in ("rich", "tqdm"):
        with contextlib.suppress(ImportError):
            __import__(name)
            return name
    return ""


@contextlib.contextmanager
def _progress(source: TextSource) -> Iterator[Any]:
    """Yields `advance(units, tokens_so_far)`."""
    total, unit = source.progress_total
    library = _bar_library()
    if library == "rich":
        import rich.console as rc
        import rich.progress as rp

        count = rp.DownloadColumn() if unit == "bytes" else rp.MofNCompleteColumn()
        columns = (rp.TextColumn("tokenizing"), rp.BarColumn(), count, rp.TextColumn("{task.fields[tok]}"),
                   rp.TimeElapsedColumn(), rp.TimeRemainingColumn())
        with rp.Progress(*columns, console=rc.Console(stderr=True)) as bar:
            task = bar.add_task("tokenizing", total=total, tok="")
            yield lambda n, tokens: bar.update(task, advance=n, tok=f"{tokens:,} tokens")
        return
    if library == "tqdm":
        from tqdm import tqdm

        with tqdm(total=total, desc="tokenizing", unit="B" if unit == "bytes" else " rows", unit_scale=True) as t:
            yield lambda n, tokens: t.update(n)
        return
    done, last = 0, time.monotonic()

    def advance(n: int, tokens: int) -> None:
        nonlocal done, last
        done += n
        if time.monotonic() - last >= 30:
            last = time.monotonic()
            share = f" ({100 * done / total:.0f}%)" if total else ""
            _log(f"data: {done:,} {unit}{share}, {tokens:,} tokens so far")

    yield advance
