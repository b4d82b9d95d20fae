"""Tokenizing one source into the token cache: streaming, on the cores given, resumable.

    index = write_tokens(source, tokenizer, paths, num_proc=8, prepared_by="slipway prepare on login1")

Memory stays bounded whatever the dataset's size: the source is read in batches of about
`BATCH_CHARS` characters, at most two per thread are in flight, and tokens go to disk as they come.

Threads, not processes: each of `num_proc` threads runs `encode_batch` on a whole batch with the
tokenizers library's own (Rayon) parallelism off, the GIL released while Rust encodes; the main
thread reads ahead and writes in order. This keeps every core busy (Rayon's pool waits for each
batch's longest document, and is sized once per process), and won on every count in `bench/data.py`
against Rayon's pool and a process pool (BENCHMARKS.md).

Crashes and reruns: tokens go to `<stem>.bin.partial` at their final offsets. Every `CHECKPOINT_S`
seconds the partial file is fsynced, then `<stem>.progress` records, atomically, the source position
after the last batch written and the byte count. A rerun whose inputs match the record continues
from there; with no usable record it starts again. Either way it writes the same bytes at the same
offsets as an uninterrupted run, truncates only at the very end, and so yields an identical file (as
two writers that both think they hold the lock would). Only when all is written is the partial
renamed to `<stem>.bin`, then the index written: the index marks a complete entry, and a crash never
leaves a `.bin` or `.json` behind.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from common.errors import ConfigError
from trainer.data_sources import (BUILTIN, BUILTIN_TOKENIZER, EOS_CANDIDATES, Batch, Reader, TextSource, expand_spec,
                                  hub_unreachable, looks_local)
from common.fs import NotRegularFile, file_sha256, fsync_dir, load_json, write_atomic

if TYPE_CHECKING:
    import numpy as np
    from rich.console import Console

FORMAT_VERSION = 1
# The token file's dtypes, with their bytes per token: what reading an index needs without numpy
# (which only making or mapping tokens imports: the login node's base install reads indexes).
TOKEN_DTYPES = {"uint16": 2, "uint32": 4}
CHECKPOINT_S = 10.0  # at most this much tokenizing is redone after a crash
LOG_EVERY_S = 30.0  # progress lines in a log file (no terminal)


# ---------------------------------------------------------------- progress


@dataclass(frozen=True)
class Progress:
    """A snapshot of one tokenization, for a callback."""

    source: str  # the source's description
    documents: int  # non-empty documents tokenized so far (an interrupted run's included)
    tokens: int  # tokens written so far (an interrupted run's included)
    done: int  # progress units read, of `total`
    total: int | None
    unit: str  # "bytes" (files) or "rows" (datasets)
    seconds: float  # since this run started
    resumed_tokens: int = 0  # tokens an interrupted run had written before this one continued
    resumed_done: int = 0  # units that run had read

    @property
    def tokens_per_s(self) -> float:
        return (self.tokens - self.resumed_tokens) / max(self.seconds, 1e-9)

    @property
    def eta_s(self) -> float | None:
        """Seconds left at this run's rate, when the total is known."""
        rate = (self.done - self.resumed_done) / max(self.seconds, 1e-9)
        return (self.total - self.done) / rate if self.total and rate > 0 else None

    def line(self) -> str:
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        eta = self.eta_s
        return (f"data: {self.source}: {self.done:,} {self.unit}{share}, {self.documents:,} documents, "
                f"{self.tokens:,} tokens, {self.tokens_per_s / 1e6:.2f} M tokens/s"
                f"{f', about {eta:.0f}s left' if eta is not None else ''}")


# A rich Console (draw a bar there), a callback, or None (a bar on a terminal, else log lines).
ProgressSink = Union["Console", Callable[[Progress], None], None]


def note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _display(sink: ProgressSink, description: str, reader: Reader) -> Iterator[Callable[[Progress], None]]:
    """Yields `show(progress)`, called after every batch."""
    if callable(sink):
        yield sink
        return
    from rich.console import Console

    console = sink if sink is not None else Console(stderr=True)
    if not console.is_terminal:  # a log file: a line now and then
        last = time.monotonic()

        def log_line(p: Progress) -> None:
            nonlocal last
            if time.monotonic() - last >= LOG_EVERY_S:
                last = time.monotonic()
                console.print(p.line(), markup=False, highlight=False, soft_wrap=True)  # "[train]" is text

        yield log_line
        return
    import rich.progress as rp

    columns = (rp.TextColumn("tokenizing {task.description}", markup=False), rp.BarColumn(), rp.TaskProgressColumn(),
               rp.TextColumn("{task.fields[documents]} docs, {task.fields[tokens]} tokens, {task.fields[rate]}"),
               rp.TimeElapsedColumn(), rp.TextColumn("ETA"), rp.TimeRemainingColumn())
    with rp.Progress(*columns, console=console) as bar:
        task = bar.add_task(description, total=reader.total, completed=reader.done, documents="0", tokens="0",
                            rate="")

        def update(p: Progress) -> None:
            bar.update(task, completed=p.done, documents=f"{p.documents:,}", tokens=f"{p.tokens:,}",
                       rate=f"{p.tokens_per_s / 1e6:.2f} M tok/s")

        yield update


# ---------------------------------------------------------------- encoding on threads


def _encoder(tok: Any, eos: int, dtype: np.dtype) -> Callable[[list[str]], np.ndarray]:
    import numpy as np

    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast skips the offsets we do not use

    def encode_docs(texts: list[str]) -> np.ndarray:
        """The documents' ids, each followed by the EOS id, flat."""
        ids = [e.ids for e in encode(texts, add_special_tokens=False)]
        count = sum(map(len, ids)) + len(ids)
        return np.fromiter(itertools.chain.from_iterable(itertools.chain(x, (eos,)) for x in ids), dtype, count)

    return encode_docs


def _encoded(batches: Iterator[Batch], encode: Callable[[list[str]], np.ndarray],
             workers: int) -> Iterator[tuple[Batch, np.ndarray]]:
    """`encode` over the batches on `workers` threads, in order, at most
    2 x workers batches in flight (the reading runs ahead only that far)."""
    pending: deque[tuple[Batch, Future[np.ndarray]]] = deque()
    pool = ThreadPoolExecutor(workers, thread_name_prefix="slipway-tokenize")
    try:
        for batch in batches:
            pending.append((batch, pool.submit(encode, batch.texts)))
            if len(pending) >= 2 * workers:
                done, future = pending.popleft()
                yield done, future.result()
        while pending:
            done, future = pending.popleft()
            yield done, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True)
class CachePaths:
    """A cache entry's files (trainer/data_cache.py names them), which the writer here fills."""

    dir: Path
    stem: str

    def _p(self, suffix: str) -> Path:
        return self.dir / f"{self.stem}{suffix}"

    bin = property(lambda self: self._p(".bin"))
    index = property(lambda self: self._p(".json"))
    partial = property(lambda self: self._p(".bin.partial"))
    progress = property(lambda self: self._p(".progress"))
    lock = property(lambda self: self._p(".lock"))
    error = property(lambda self: self._p(".error"))


# ---------------------------------------------------------------- writing, with a resume record


@dataclass
class _State:
    """How far the partial file is written: what a resume record holds."""

    position: tuple[int, int] = (0, 0)  # the source's position after the last batch written
    n_tokens: int = 0
    n_documents: int = 0
    n_chars: int = 0


def _read_record(paths: CachePaths, inputs: dict, dtype: np.dtype) -> _State | None:
    """The resume record, if it belongs to these inputs and its partial file is at least that long."""
    try:
        record = load_json(paths.progress, 1 << 20)
    except (NotRegularFile, ValueError):
        note(f"data: ignoring the unreadable resume record {paths.progress}; starting from the beginning")
        return None
    if record is None:
        return None
    state = _State(tuple(record["position"]), record["n_tokens"], record["n_documents"], record["n_chars"])
    size = paths.partial.stat().st_size if paths.partial.exists() else -1
    usable = (record.get("format") == FORMAT_VERSION and record.get("inputs") == inputs
              and record.get("dtype") == dtype.name and size >= state.n_tokens * dtype.itemsize)
    if not usable:
        note(f"data: the resume record {paths.progress} does not match {paths.partial}; starting from the beginning")
        return None
    return state


def _checkpoint(f: Any, paths: CachePaths, state: _State, inputs: dict, dtype: np.dtype) -> None:
    """Data first, then the record that points into it."""
    f.flush()
    os.fsync(f.fileno())
    record = {"format": FORMAT_VERSION, "inputs": inputs, "dtype": dtype.name, **asdict(state),
              "bytes": state.n_tokens * dtype.itemsize, "written": time.time()}
    write_atomic(paths.progress, json.dumps(record))


def partial_tokens(paths: CachePaths) -> int:
    """Tokens an interrupted writer recorded in `paths.progress` (0 when none)."""
    try:
        return int(load_json(paths.progress, 1 << 20)["n_tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def write_tokens(source: TextSource, tokenizer: TokenizerSpec, paths: CachePaths, num_proc: int = 0, *,
                 prepared_by: str = "", progress: ProgressSink = None) -> dict:
    """Tokenize `source` into `paths.bin` and its index (returned), continuing an interrupted run."""
    import numpy as np

    workers = num_proc or len(os.sched_getaffinity(0))  # a Slurm task's cpuset, not the node's cores
    tok = load_tokenizer(tokenizer)
    eos = eos_id(tok, tokenizer.spec)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype("uint16" if vocab <= 1 << 16 else "uint32")
    inputs = {"source": source.identity, "tokenizer": tokenizer.identity}
    state = _read_record(paths, inputs, dtype) or _State()
    resumed, reader = state.n_tokens, source.open(state.position)
    what = (f"resuming the tokenization of {source.description} at {resumed:,} tokens" if resumed
            else f"tokenizing {source.description} with {tokenizer.description}")
    note(f"data: {what} ({workers} threads) -> {paths.bin}")
    start = time.monotonic()
    try:
        _write_partial(source.description, reader, paths, state, inputs, dtype, _encoder(tok, eos, dtype), workers,
                       progress)
        if state.n_tokens == 0:
            raise ConfigError(source.field, f"{source.description} holds no text in column '{source.column}'")
    except ConfigError:  # the inputs are wrong: nothing worth resuming
        for path in (paths.partial, paths.progress):
            path.unlink(missing_ok=True)
        raise
    seconds = time.monotonic() - start
    os.replace(paths.partial, paths.bin)
    index = {"format": FORMAT_VERSION, "dtype": dtype.name, "n_tokens": state.n_tokens, "vocab_size": vocab,
             "eos_id": eos, "n_documents": state.n_documents, "n_chars": state.n_chars,
             "source": source.description, "tokenizer": tokenizer.description, "inputs": inputs,
             "prepared_by": prepared_by, "threads": workers, "resumed_from_tokens": resumed,
             "seconds": round(seconds, 3), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_atomic(paths.index, json.dumps(index, indent=1))
    paths.progress.unlink(missing_ok=True)
    fsync_dir(paths.dir)
    rate = (state.n_tokens - resumed) / max(seconds, 1e-9)
    note(f"data: tokenized {source.description}: {state.n_documents:,} documents, {state.n_tokens:,} tokens "
         f"in {seconds:.1f}s ({rate / 1e6:.2f} M tokens/s{f', resumed at {resumed:,}' if resumed else ''}) "
         f"-> {paths.bin}")
    return index


def _write_partial(description: str, reader: Reader, paths: CachePaths, state: _State, inputs: dict,
                   dtype: np.dtype, encode: Callable[[list[str]], np.ndarray], workers: int,
                   progress: ProgressSink) -> None:
    """The reader's tokens into `paths.partial` from `state` on (updated as they are written),
    with a resume record every CHECKPOINT_S seconds; synced to disk at the end."""
    resumed, start = state.n_tokens, time.monotonic()
    last_checkpoint, units = start, 0  # units: read by this run (rows skipped in the first file included)
    from unittest import mock  # here: its import (asyncio's) costs every command that reads a cache 30 ms

    # Each encode_batch on one core: our threads share out the cores (Rayon's pool would not follow num_proc).
    with open(paths.partial, "r+b" if paths.partial.exists() else "wb") as f, \
            _display(progress, description, reader) as show, \
            mock.patch.dict(os.environ, {"TOKENIZERS_PARALLELISM": "false"}):
        f.seek(state.n_tokens * dtype.itemsize)
        for batch, ids in _encoded(reader.batches, encode, workers):
            f.write(ids.data)
            state.position, units = batch.position, units + batch.units
            state.n_tokens += len(ids)
            state.n_documents += len(batch.texts)
            state.n_chars += sum(map(len, batch.texts))
            show(Progress(description, state.n_documents, state.n_tokens, reader.done + units,
                          reader.total, reader.unit, time.monotonic() - start, resumed, reader.done))
            if time.monotonic() - last_checkpoint >= CHECKPOINT_S:
                _checkpoint(f, paths, state, inputs, dtype)
                last_checkpoint = time.monotonic()
        f.truncate(state.n_tokens * dtype.itemsize)  # a restart over a longer partial file
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------- tokenizers


@dataclass(frozen=True)
class TokenizerSpec:
    spec: str
    description: str
    identity: dict[str, Any]
    path: Path | None = None  # a tokenizer.json, or a directory for transformers


def resolve_tokenizer(spec: str) -> TokenizerSpec:
    """The tokenizer `spec` names, identified by content (local) or by name (hub)."""
    if spec == BUILTIN:
        return TokenizerSpec(spec, "builtin (trainer/assets/tokenizer.json)",
                             {"kind": "builtin", "sha256": file_sha256(BUILTIN_TOKENIZER)}, BUILTIN_TOKENIZER)
    path = Path(expand_spec(spec))
    if not path.exists():
        if looks_local(spec) or spec.endswith(".json"):
            raise ConfigError("data.tokenizer", f"path '{spec}' does not exist (working directory {os.getcwd()}); "
                              "give a tokenizer.json, a directory holding one, 'builtin', or a hub name like gpt2")
        return TokenizerSpec(spec, f"{spec} (Hugging Face hub)", {"kind": "hub", "name": spec})
    if path.is_dir():
        if (path / "tokenizer.json").exists():
            path = path / "tokenizer.json"
        else:
            files = sorted(p for p in path.iterdir() if p.is_file())
            if not files:
                raise ConfigError("data.tokenizer", f"directory '{spec}' is empty; it needs a tokenizer.json")
            return TokenizerSpec(spec, f"{spec} (transformers, local)",
                                 {"kind": "dir", "files": {p.name: file_sha256(p) for p in files}}, path)
    return TokenizerSpec(spec, str(path), {"kind": "file", "sha256": file_sha256(path)}, path)


def load_tokenizer(spec: TokenizerSpec) -> Any:
    """A `tokenizers.Tokenizer` (fast, with a parallel `encode_batch`)."""
    from tokenizers import Tokenizer

    if spec.path is not None and spec.path.is_file():
        try:
            return Tokenizer.from_file(str(spec.path))
        except Exception as exc:
            raise ConfigError("data.tokenizer", f"'{spec.path}' is not a tokenizers JSON file "
                              f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    if spec.path is not None:
        return _transformers_tokenizer(str(spec.path), spec.spec, local=True)
    if unreachable := hub_unreachable():
        raise ConfigError("data.tokenizer", f"'{spec.spec}' is no local file and {unreachable}: check the name, and "
                          "run `slipway prepare CONFIG` where the hub can be reached (offline: HF_HUB_OFFLINE=1 with HF_HOME "
                          "holding it), or give a local tokenizer.json")
    try:
        from huggingface_hub import hf_hub_download

        return Tokenizer.from_file(hf_hub_download(spec.spec, "tokenizer.json"))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if type(exc).__name__ in ("EntryNotFoundError", "RemoteEntryNotFoundError"):  # vocab.json + merges.txt
            return _transformers_tokenizer(spec.spec, spec.spec, local=False)
        raise ConfigError("data.tokenizer", f"could not load tokenizer '{spec.spec}' from the Hugging Face hub "
                          f"({type(exc).__name__}: {first}); check the name and network access (offline: "
                          "HF_HUB_OFFLINE=1 with HF_HOME holding it), or give a local tokenizer.json") from None


def _transformers_tokenizer(where: str, spec: str, local: bool) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError("data.tokenizer", f"'{spec}' has no tokenizer.json and transformers is not installed "
                          "to convert it; save it as tokenizer.json (tokenizers library)") from None
    try:
        tok = AutoTokenizer.from_pretrained(where, local_files_only=local)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError("data.tokenizer", f"could not load tokenizer '{spec}': {first}") from None
    if not getattr(tok, "is_fast", False):
        raise ConfigError("data.tokenizer", f"'{spec}' has only a slow (Python) tokenizer; convert it to a "
                          "tokenizer.json with the tokenizers library")
    return tok.backend_tokenizer


def eos_id(tokenizer: Any, spec: str = "") -> int:
    """The id that separates documents in the token stream."""
    for token in EOS_CANDIDATES:
        tid = tokenizer.token_to_id(token)
        if tid is not None:
            return tid
    raise ConfigError("data.tokenizer", f"tokenizer '{spec}' has none of the end-of-text tokens "
                      f"{', '.join(EOS_CANDIDATES)}, so documents cannot be separated; add one as a special token")
