"""manifest.json: what a run pinned and launched, one typed model, read and written here only.

`Manifest` and its launches (`Launch`) are dataclasses whose fields are the file's keys, read by
the configs' schema engine as a record (common/schema.py `from_dict`: every key checked against its
field's type, unknown keys kept in `others` and written back). `write` is the one writer (atomic;
jobs.runs.update_manifest calls it under the run's lock). A manifest that cannot be read (missing,
empty, cut short, not JSON, wrong types, too large, or of a newer format) is a `ManifestError`:
one line naming the file and what to do, raised only where that run is read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional, Union

from common.errors import ConfigError, bounded, bounded_path, shown
from common.fs import NotRegularFile, ownership, read_file, write_atomic
from common.rundir import LOCAL_JOB, CodeSnapshot
from common.schema import from_dict, require
from jobs.runs.image import ImagePin

# 1: the first versioned format; a manifest without `schema` (written before it) reads the same.
SCHEMA = 1
MAX_BYTES = 32 << 20  # a run resubmitted ten thousand times writes about 8 MiB
_JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")
NOT_A_KEY = {"config": False}  # a field of the model that is no key of the file (common/schema.py config_fields)


class ManifestError(ConfigError):
    """A run's manifest.json that cannot be read: for that run, nothing can be told of its launches."""

    def __init__(self, path: Path, why: str, stake: str = "", fix: str = "", newer: Optional[int] = None,
                 denied: bool = False):
        # denied: the user may not read it (a teammate's run), which is no damage
        self.path, self.why, self.newer, self.denied = Path(path), why, newer, denied
        name = self.path.parent.name
        stake = stake or "slipway cannot tell this run's launches from it"
        if newer is not None:  # not damaged: this slipway is too old to read it, and must not rewrite it
            fix = fix or "run the newer slipway that wrote it, or upgrade this one (pip install -U slipway)"
            super().__init__(bounded_path(self.path), f"written by a newer slipway (manifest format {newer}; this one "
                                                      f"reads format {SCHEMA} and older): {stake}; {fix}")
            return
        if denied:  # not damaged either: someone else's run
            super().__init__(bounded_path(self.path), f"{why}: {stake}; a teammate's run? ask its owner")
            return
        fix = fix or (f"restore it from a backup, or move the run directory aside and submit afresh "
                      f"(`squeue --name {name},{name}-prepare` lists the run's jobs still in Slurm)")
        super().__init__(bounded_path(self.path), f"damaged ({why}): {stake}; {fix}")

    def restated(self, stake: str, fix: str) -> "ManifestError":
        """The same damage, told for what a command could not do because of it."""
        return ManifestError(self.path, self.why, stake, fix, self.newer, self.denied)


@dataclass(frozen=True)
class Launch:
    """One launch of a run, as `submissions` records it: a Slurm job (attempts under one id) or `local`."""

    job_id: Optional[str] = None  # the Slurm job id; None for a local launch
    kind: str = "train"  # "train" or "prepare" (a data preparation job); a local launch trains
    local: bool = False
    submitted: str = ""  # when sbatch took it (ISO 8601)
    started: str = ""  # local: when it started (Slurm's attempts start in events.log)
    ended: str = ""  # local: when the launcher recorded its end
    after: str = ""  # Slurm: the job it waits for (a train job after its prepare job)
    pid: Optional[int] = None  # local: the launcher's pid (it outlives the trainer and records the end)
    trainer_pid: Optional[int] = None
    host: str = ""
    log: str = ""  # local: its log, relative to the run directory
    allocation: str = ""  # `slipway run`: the allocation it ran in
    exit: Union[int, str, None] = None  # local: its exit code, or "interrupted" (Ctrl-C)
    signal: Union[str, int, None] = None  # local: the signal that stopped it (its name)
    trainer_exit: Optional[int] = None  # local: the trainer's own code when a signal stopped it
    steps: Optional[int] = None  # train.steps of the config it launched with
    git: dict = field(default_factory=dict, compare=False)
    image: Optional[ImagePin] = field(default=None, compare=False)
    code: Optional[CodeSnapshot] = field(default=None, compare=False)
    script_sha256: str = ""
    job_lib: dict = field(default_factory=dict, compare=False)  # the libraries its batch script sources
    cluster: dict = field(default_factory=dict, compare=False)  # the cluster profile it was submitted with
    others: dict = field(default_factory=dict, compare=False, repr=False, metadata=NOT_A_KEY)  # keys it does not know

    ALWAYS: ClassVar[tuple[str, ...]] = ("job_id", "kind")  # written even at their defaults

    @property
    def id(self) -> str:
        """The job field of its events: the Slurm job id, LOCAL_JOB for a local launch."""
        return LOCAL_JOB if self.local else str(self.job_id)

    @property
    def recorded_exit(self) -> Optional[int]:
        return self.exit if isinstance(self.exit, int) and not isinstance(self.exit, bool) else None

    @property
    def interrupted(self) -> bool:
        return self.exit == "interrupted"

    @property
    def signal_number(self) -> Optional[int]:
        value = self.signal
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value:
            name = value.upper() if value.upper().startswith("SIG") else f"SIG{value.upper()}"
            try:
                return int(signal.Signals[name])
            except KeyError:
                return int(value) if value.isdigit() else None
        return None

    @property
    def recorded(self) -> bool:
        """Whether the launcher recorded this (local) launch's end."""
        return self.recorded_exit is not None or self.interrupted or self.signal_number is not None

    def same(self, other: "Launch") -> bool:
        """One launch seen twice (re-read from the manifest): a process may launch twice, as tests do."""
        if self.local or other.local:
            return self.local and other.local and self.pid == other.pid and self.started == other.started
        return self.job_id == other.job_id

    def check(self, where: str) -> None:
        require(self.local or (isinstance(self.job_id, str) and _JOB_ID.fullmatch(self.job_id) is not None),
                f"{where}.job_id", lambda: f"{shown(self.job_id, 'job_id')} is no Slurm job id (and it is no local launch)")
        require(self.kind in ("train", "prepare"), f"{where}.kind",
                lambda: f"{shown(self.kind, 'kind')} is neither train nor prepare")
        require(not self.log or not (Path(self.log).is_absolute() or ".." in Path(self.log).parts), f"{where}.log",
                lambda: f"{shown(self.log, 'log')} is not a path inside the run directory")
        require(not isinstance(self.exit, str) or self.interrupted, f"{where}.exit",
                lambda: f"{shown(self.exit, 'exit')} is neither an exit code nor \"interrupted\"")


@dataclass
class Manifest:
    schema: int = SCHEMA
    run: str = ""
    created: str = ""
    project_dir: str = ""
    git: dict = field(default_factory=dict)
    image: Optional[ImagePin] = None  # what the latest job runs
    runtime: str = ""
    launcher: str = ""
    config_sha256: str = ""
    submissions: list[Launch] = field(default_factory=list)  # oldest first
    code: Optional[CodeSnapshot] = None  # what the latest training launch runs (None: the image's own)
    job_lib: dict = field(default_factory=dict)  # lib/NAME-HASH12.sh -> sha256, checked by the latest script
    others: dict = field(default_factory=dict, repr=False, metadata=NOT_A_KEY)  # keys it does not know

    ALWAYS: ClassVar[tuple[str, ...]] = ("*",)

    def images(self) -> list[ImagePin]:
        """Every image a job of the run was submitted with (a requeue runs its own job's)."""
        return [pin for pin in (self.image, *(x.image for x in self.submissions)) if pin is not None]

    def snapshots(self) -> list[CodeSnapshot]:
        """Every code snapshot the run names: its own and each launch's."""
        return [c for c in (self.code, *(x.code for x in self.submissions)) if c is not None]


def _plain(value: Any) -> Any:
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if hasattr(value, "record"):
        return value.record()
    if dataclasses.is_dataclass(value):
        return to_record(value)
    return value


def to_record(obj: Any) -> dict:
    """A Manifest's or Launch's JSON object: its fields (a Launch's where not default), then a newer slipway's keys."""
    out: dict[str, Any] = {}
    every = "*" in obj.ALWAYS
    for f in fields(obj):
        if f.metadata is NOT_A_KEY:
            continue
        value = getattr(obj, f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if every or f.name in obj.ALWAYS or value != default:
            out[f.name] = _plain(value)
    for key, value in obj.others.items():
        out.setdefault(key, value)
    return out


def read(path: Path) -> Manifest:
    """The manifest at `path`, validated; ManifestError when it cannot be read."""
    return read_record(path, Manifest, "manifest", SCHEMA, ManifestError)


def read_record(path: Path, cls: type, where: str, newest: int, error: Callable[..., ConfigError]) -> Any:
    """The JSON record slipway wrote at `path` (manifest.json, sweep.json) as `cls`, by the schema
    engine; `error(path, why)` where it cannot be read (`denied`: the user may not; `newer`: a
    format past `newest`, whose keys may mean what this slipway cannot tell)."""
    try:
        found = read_file(path, MAX_BYTES)
        if found is None:
            raise error(path, "missing")
        data = found[0]
    except OSError as exc:
        denied = isinstance(exc, PermissionError)
        why = f"not readable by you ({ownership(path)})" if denied else \
            f"cannot be read: it {exc.strerror or exc}" if isinstance(exc, NotRegularFile) else \
            f"cannot be read: {exc.strerror or exc}"
        raise error(path, why, denied=denied) from None
    if data is None:
        raise error(path, f"larger than {MAX_BYTES >> 20} MiB")
    if not data.strip():
        raise error(path, "empty")
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise error(path, "not UTF-8 text") from None
    except RecursionError:
        raise error(path, "nested too deeply") from None
    except ValueError as exc:
        raise error(path, f"not JSON: {bounded(str(exc), 120)}") from None
    if not isinstance(raw, dict):
        raise error(path, f"{_KINDS.get(type(raw), type(raw).__name__)}, not an object")
    schema = raw.get("schema")
    if type(schema) is int and schema > newest:
        raise error(path, f"written by a newer slipway (format {schema})", newer=schema)
    try:
        return from_dict(cls, raw, where, record=True)
    except ConfigError as exc:
        raise error(path, str(exc).removeprefix(f"{where}.")) from None


_KINDS = {list: "a list", str: "a string", bool: "a boolean", int: "an integer", float: "a number",
          type(None): "null"}


def write(path: Path, manifest: Manifest) -> None:
    """Write `manifest` to `path` atomically (a reader sees the old file or the new, never half)."""
    write_atomic(path, json.dumps(to_record(manifest), indent=2) + "\n")


def file_key(path: Path) -> Optional[tuple[int, int, int]]:
    """What changes whenever the manifest is rewritten (write_atomic makes a new file): None if absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size
