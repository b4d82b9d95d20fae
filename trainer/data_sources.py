"""Where the training text comes from (`data.dataset`): `builtin` (`assets/corpus.jsonl.gz`, real
English prose shipped with slipway); a local path: a `save_to_disk` directory (Dataset or
DatasetDict), or parquet, JSON Lines / JSON-array, or `.txt` files (`.gz` allowed for the text
formats; a `.txt` file holds one document per blank-line-separated paragraph), given as one
file, a directory of them, or a glob; anything else is a Hugging Face hub name for
`datasets.load_dataset`. Local paths never touch the network. Empty documents are skipped.

`resolve_source` is cheap and runs on every rank: it checks paths and splits and computes the
source's identity (what the token cache key hashes) without reading the data. Only the one
process that tokenizes calls `TextSource.open`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import gzip
import io
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from common.fs import file_sha256
from trainer.config import DataSection

ASSETS = Path(__file__).resolve().parent / "assets"
BUILTIN = "builtin"
BUILTIN_CORPUS = ASSETS / "corpus.jsonl.gz"
BUILTIN_TOKENIZER = ASSETS / "tokenizer.json"
# Formats by suffix; the text formats may also end in .gz.
FORMATS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# Document separators to look for, most common first.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")
# Text per batch: one thread encodes one batch. 256 K characters (~70 K tokens, ~0.1 s of one core)
# make the per-call cost negligible and the threads' uneven finish at the end short; two batches
# per thread in flight keep the memory at about 0.5 MB of text per thread.
BATCH_CHARS = 1 << 18
HUB_FIX = ("check the name, and run `slipway prepare CONFIG` where the hub can be reached (a login node; offline: "
           "HF_HUB_OFFLINE=1 with HF_HOME holding it), or give a local path")


def expand_spec(spec: str) -> str:
    return os.path.expanduser(os.path.expandvars(spec))


def _file_format(path: Path) -> str | None:
    name = path.name.lower()
    fmt = FORMATS.get(Path(name.removesuffix(".gz")).suffix)
    return None if fmt == "parquet" and name.endswith(".gz") else fmt


def _stat_identity(paths: list[Path]) -> list[list[Any]]:
    """Size and mtime of each file: cheap, and changes whenever the data does."""
    return [[str(p.resolve()), (st := p.stat()).st_size, st.st_mtime_ns] for p in paths]


def _slug(text: str) -> str:
    keep = "".join(c if c.isalnum() or c in "-_." else "-" for c in text)
    return "-".join(filter(None, keep.split("-")))[:60] or "data"


def looks_local(spec: str) -> bool:
    """A path rather than a hub name: it exists, is explicitly a path, has a
    known suffix, or is a glob. (`org/name` alone is a hub name.)"""
    expanded = expand_spec(spec)
    return (Path(expanded).exists() or spec.startswith(("/", "./", "../", "~", "$"))
            or any(c in spec for c in "*?[") or _file_format(Path(expanded)) is not None)


# ---------------------------------------------------------------- datasets


@dataclass(frozen=True)
class Batch:
    """Documents read in order, and where the source stands after them."""

    texts: list[str]  # the non-empty documents
    position: tuple[int, int]  # (file, row of that file) after the last row read: a rerun resumes here
    units: int  # progress this batch stands for (bytes of the files, or rows of a dataset)


@dataclass
class Reader:
    """An opened source: its progress total, and its batches from a position on."""

    batches: Iterator[Batch]
    total: int | None  # in `unit`s; None when unknown
    unit: str  # "bytes" or "rows"
    done: int  # units the start position stands for


@dataclass(frozen=True)
class TextSource:
    """One split of one dataset, ready to be read by the tokenizing process."""

    kind: str  # "files", "saved" or "hub"
    description: str
    slug: str
    identity: dict[str, Any]
    column: str
    field: str = "data.dataset"
    files: tuple[Path, ...] = ()
    fmt: str = ""
    name: str = ""  # hub name or saved directory
    config: str | None = None
    split: str = "train"
    total_bytes: int = dataclasses.field(default=0, compare=False)

    def open(self, start: tuple[int, int] = (0, 0)) -> Reader:
        """Batches from `start` (a `Batch.position` of an earlier read) on. Rows before `start` are
        skipped unparsed where the format allows, so resuming costs a read, not a tokenization.
        A hub dataset is downloaded here."""
        first_file, first_row = start
        if self.kind == "files":
            reader = {"text": _read_text, "json": _read_json, "parquet": _read_parquet}[self.fmt]
            rows: Iterator[tuple[int, str | None, int]] = (
                (i, text, units) for i in range(first_file, len(self.files))
                for text, units in reader(self.files[i], self.column, first_row if i == first_file else 0))
            done = sum(p.stat().st_size for p in self.files[:first_file])
            return Reader(_batched(rows, (first_file, 0)), self.total_bytes, "bytes", done)
        ds = self._load_dataset()
        if self.column not in ds.column_names:
            raise _column_error(self.column, list(ds.column_names), self.description)
        ds = ds.select_columns([self.column])  # read in arrow slices from first_row on: no skipping cost
        rows = ((0, text, 1) for i in range(first_row, len(ds), 4096) for text in ds[i:i + 4096][self.column])
        return Reader(_batched(rows, (0, first_row)), len(ds), "rows", first_row)

    def _load_dataset(self) -> Any:
        import datasets

        if self.kind == "saved":
            ds = datasets.load_from_disk(self.name)
            return ds[self.split] if isinstance(ds, datasets.DatasetDict) else ds
        if unreachable := hub_unreachable():
            raise ConfigError(self.field, f"'{self.name}' is no local path and {unreachable}: {HUB_FIX}")
        try:
            return datasets.load_dataset(self.name, self.config, split=self.split)
        except ValueError as exc:  # unknown split or config
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            split_field = "data.validation_split" if self.field == "data.validation_split" else "data.split"
            where = split_field if "split" in first.lower() else "data.dataset_config"
            raise ConfigError(where, f"{self.description}: {first}") from None
        except Exception as exc:  # network, missing dataset, offline without a cache
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ConfigError(self.field, f"could not load '{self.name}' from the Hugging Face hub "
                              f"({type(exc).__name__}: {first}); {HUB_FIX}") from None


def _offline() -> bool:
    """Whether the hub's clients are in offline mode (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE, as they read it)."""
    if any(os.environ.get(v, "") not in ("", "0") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return True
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(constants.HF_HUB_OFFLINE)


def hub_unreachable(timeout: float = 5.0) -> str | None:
    """Why the Hugging Face hub (HF_ENDPOINT) cannot be reached from here, in a few seconds: a name
    that does not resolve, a connection refused or timed out; None when it answers, when offline
    mode is on (the cache is used), or behind a proxy (which only the hub's own client uses).
    Without it, a misspelt name or a node without network costs half a minute of retries."""
    import socket
    from urllib.parse import urlsplit

    if _offline() or any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        return f"the Hugging Face hub ({host}) cannot be reached from here ({reason})"
    return None


def _batched(rows: Iterator[tuple[int, str | None, int]], start: tuple[int, int]) -> Iterator[Batch]:
    """Rows (file, text or None, units) into batches of about BATCH_CHARS characters, rows counted per file."""
    file, row = start
    texts: list[str] = []
    chars = units = 0
    for i, text, unit in rows:
        if i != file:
            file, row = i, 0
        row += 1
        units += unit
        if text and not text.isspace():
            texts.append(text)
            chars += len(text)
        if chars >= BATCH_CHARS:
            yield Batch(texts, (file, row), units)
            texts, chars, units = [], 0, 0
    if texts or units:
        yield Batch(texts, (file, row), units)


def _column_error(column: str, columns: list[str], where: str) -> ConfigError:
    return ConfigError("data.text_column",
                       f"column '{column}' not in {where} (columns: {', '.join(columns) or 'none'})")


@contextlib.contextmanager
def _text_file(path: Path) -> Iterator[tuple[io.TextIOWrapper, Callable[[], int]]]:
    """A text file (gzip or not), and how many bytes of the file on disk were read since the last
    call, for an honest progress bar."""
    with open(path, "rb") as raw:
        stream: Any = gzip.GzipFile(fileobj=raw) if path.name.lower().endswith(".gz") else raw
        read = [0]

        def advance() -> int:
            delta, read[0] = raw.tell() - read[0], raw.tell()
            return delta

        with io.TextIOWrapper(stream, encoding="utf-8", errors="replace") as text:
            yield text, advance


# Each reader yields every row of its file as (text or None, progress units), in
# order; the first `skip` rows (already tokenized by an interrupted run) come as
# (None, units), unparsed where the format allows, so rows keep their numbers.


def _read_text(path: Path, column: str, skip: int = 0) -> Iterator[tuple[str | None, int]]:
    """Blank-line-separated paragraphs, each a document."""
    lines: list[str] = []
    row = 0
    with _text_file(path) as (text, advance):
        for line in text:
            if line.strip():
                lines.append(line)
            elif lines:
                yield ("".join(lines).rstrip("\n") if row >= skip else None), advance()
                lines, row = [], row + 1
        yield ("".join(lines).rstrip("\n") if lines and row >= skip else None), advance()


def _pick(record: Any, column: str, where: str) -> str | None:
    if not isinstance(record, dict):
        raise ConfigError("data.dataset", f"{where}: expected a JSON object per record, got {type(record).__name__}")
    if column not in record:
        raise _column_error(column, list(record), where)
    value = record[column]
    if value is not None and not isinstance(value, str):
        raise ConfigError("data.text_column", f"{where}: column '{column}' holds {type(value).__name__}, not text")
    return value


def _read_json(path: Path, column: str, skip: int = 0) -> Iterator[tuple[str | None, int]]:
    """JSON Lines, or one JSON array of objects."""
    with _text_file(path) as (text, _):
        if text.read(4096).lstrip()[:1] == "[":  # parsed whole: JSON Lines for data larger than memory
            text.seek(0)
            for i, record in enumerate(json.loads(text.read())):
                yield (_pick(record, column, f"{path} item {i}") if i >= skip else None), 0
            yield None, path.stat().st_size
            return
    with _text_file(path) as (text, advance):
        row = 0
        for lineno, line in enumerate(text, 1):
            if not line.strip():
                continue
            row += 1
            if row <= skip:  # parsed and checked by the run that wrote it
                yield None, advance()
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError("data.dataset", f"{path} line {lineno} is not JSON ({exc.msg})") from None
            yield _pick(record, column, str(path) if lineno == 1 else f"{path} line {lineno}"), advance()
        yield None, advance()


def _read_parquet(path: Path, column: str, skip: int = 0) -> Iterator[tuple[str | None, int]]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if column not in names:
        raise _column_error(column, names, str(path))
    size, n_rows = path.stat().st_size, pf.metadata.num_rows
    row = first = 0
    while first < pf.num_row_groups and row + pf.metadata.row_group(first).num_rows <= skip:
        for _ in range(pf.metadata.row_group(first).num_rows):  # row groups before `skip` are never read
            row += 1
            yield None, size * row // n_rows - size * (row - 1) // n_rows
        first += 1
    if first == pf.num_row_groups:
        return
    for batch in pf.iter_batches(columns=[column], batch_size=4096, row_groups=range(first, pf.num_row_groups)):
        for v in batch.column(0).to_pylist():
            row += 1
            yield (v if row > skip else None), size * row // n_rows - size * (row - 1) // n_rows


def resolve_source(spec: str, config: str | None, split: str, column: str,
                   field: str = "data.dataset") -> TextSource:
    """The dataset `spec` names, checked without reading it (cheap, every rank)."""
    if spec == BUILTIN:
        return TextSource(kind="files", description="builtin corpus (trainer/assets/corpus.jsonl.gz)",
                          slug="builtin", column=column, field=field, files=(BUILTIN_CORPUS,), fmt="json",
                          identity={"kind": "builtin", "sha256": file_sha256(BUILTIN_CORPUS), "column": column},
                          total_bytes=BUILTIN_CORPUS.stat().st_size)
    if not looks_local(spec):
        return TextSource(kind="hub", description=f"{spec}{'/' + config if config else ''}[{split}]",
                          slug=_slug(f"{spec}-{config or ''}-{split}"), column=column, field=field, name=spec,
                          config=config, split=split,
                          identity={"kind": "hub", "name": spec, "config": config, "split": split, "column": column})
    path = Path(expand_spec(spec))
    if any(c in spec for c in "*?["):
        files = [Path(p) for p in sorted(glob.glob(str(path), recursive=True)) if Path(p).is_file()]
        if not files:
            raise ConfigError(field, f"no files match '{spec}' (working directory {os.getcwd()})")
    elif not path.exists():
        raise ConfigError(field, f"path '{spec}' does not exist (working directory {os.getcwd()}); "
                          "give an existing file, directory or glob, 'builtin', or a hub dataset name")
    elif path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        return _saved_source(path, spec, split, column, field)
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
                       and _file_format(p))
        if not files:
            raise ConfigError(field, f"directory '{spec}' holds no .parquet, .jsonl, .json or .txt files "
                              "and is not a save_to_disk dataset")
    else:
        files = [path]
    formats = {_file_format(p) for p in files}
    if None in formats:
        bad = next(p for p in files if _file_format(p) is None)
        raise ConfigError(field, f"'{bad}' is not a supported file type (.parquet, .jsonl, .json, .txt, "
                          "and .jsonl.gz, .json.gz, .txt.gz)")
    if len(formats) > 1:
        raise ConfigError(field, f"'{spec}' mixes file types ({', '.join(sorted(formats))}); point it at one kind")
    (fmt,) = formats
    total = sum(p.stat().st_size for p in files)
    return TextSource(kind="files", description=f"{spec} ({len(files)} {fmt} file{'s' * (len(files) > 1)})",
                      slug=_slug(path.name.split("*")[0] or path.parent.name), column=column, field=field,
                      files=tuple(files), fmt=fmt, total_bytes=total,
                      identity={"kind": "files", "format": fmt, "files": _stat_identity(files), "column": column})


def _saved_source(path: Path, spec: str, split: str, column: str, field: str) -> TextSource:
    dict_file = path / "dataset_dict.json"
    if dict_file.exists():
        splits = json.loads(dict_file.read_text()).get("splits", [])
        if split not in splits:
            where = "data.validation_split" if field == "data.validation_split" else "data.split"
            raise ConfigError(where, f"split '{split}' not in the saved dataset '{spec}' (splits: {', '.join(splits)})")
        files = sorted(p for p in (path / split).rglob("*") if p.is_file())
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file())
        split = ""
    return TextSource(kind="saved", description=f"{spec}{f'[{split}]' if split else ''} (save_to_disk)",
                      slug=_slug(f"{path.name}-{split}"), column=column, field=field, name=str(path),
                      split=split,
                      identity={"kind": "saved", "split": split, "files": _stat_identity(files), "column": column})


def run_sources(data: DataSection) -> dict[str, TextSource]:
    """What a run reads: its "train" split, and its "validation" split when
    `data.validation_split` names one (a fraction is cut from train when read)."""
    train = resolve_source(data.dataset, data.dataset_config, data.split, data.text_column)
    if data.dataset_config and train.kind != "hub":
        raise ConfigError("data.dataset_config", f"'{data.dataset_config}' names a configuration of a hub dataset, "
                          f"but data.dataset '{data.dataset}' is local ({train.description}): remove "
                          "data.dataset_config, or give a hub dataset name")
    if not data.validation_split:
        return {"train": train}
    split = data.validation_split
    if train.kind == "files" or (train.kind == "saved" and not train.split):  # one split: validation is a path
        if not looks_local(split):
            raise ConfigError("data.validation_split",
                              f"'{split}' is a split name, but data.dataset '{data.dataset}' has a single split; "
                              "give a path to validation files, or use data.validation_fraction")
        val = resolve_source(split, None, "train", data.text_column, field="data.validation_split")
    else:
        val = resolve_source(data.dataset, data.dataset_config, split, data.text_column,
                             field="data.validation_split")
    return {"train": train, "validation": val}
