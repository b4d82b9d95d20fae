"""The run-directory protocol: the names, exit codes and event lines that the trainer,
the batch script and the host agree on. Stdlib only: the trainer imports it, and so
does the host (never the other way round).

events.log holds one line per event, `TIME job JOB TEXT`: TIME as `date
--iso-8601=seconds` writes it, JOB the Slurm job id (it survives requeues) or
`local` for a launch on this machine, TEXT free words whose start says what
happened (`EventKind`). Two writers, one per language: the batch script's bash
`event()` (jobs/slurm/job_lib.sh) and `append_event` here.
Readers go through `parse_event`, which never fails on a torn or foreign line.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path
from typing import Callable, Optional

# File names inside runs/RUN/.
EVENTS_FILE = "events.log"
MANIFEST_FILE = "manifest.json"
HEARTBEATS_DIR = "heartbeats"  # heartbeats/NODE: each node's, which `slipway watch` shows by age
GUTIL_DIR = "gutil"  # gutil/NODE.gutil: nvidia-smi dmon samples
METRICS_FILE = "metrics.jsonl"
# Rank 0's last completed step and its time, for `slipway watch`.
PROGRESS_FILE = "progress.json"
# The contract between the batch script and the trainer: on Slurm's time-limit
# warning the script creates STOP_FILE in the run directory; the trainer saves
# at the step boundary and exits REQUEUE_EXIT (EX_TEMPFAIL), "requeue me".
STOP_FILE = "stop-requested"
# A rank saw no step complete for train.hang_timeout (trainer/watchdog.py): it wrote its
# stacks to HANGS_DIR/<job>-<host>-<rank>.txt and exited HANG_EXIT; the batch script reads
# the dumps (torchrun turns every worker's exit code into 1) and exits it too unless it retries.
HANGS_DIR = "hangs"

# Exit codes of a launch, one per end: the trainer's and the batch script's (jobs/slurm/job_lib.sh),
# and the same code in events.log (`end exit N`), `slipway status`, `watch` and `logs -f`. Where the
# batch script recorded its end, that code is the launch's, whatever Slurm says of a cleanup it
# killed after it (jobs/runs/lifecycle.py). docs/runs.md lists EXIT_CODES; tests/test_docs.py checks.
BAD_INPUT_EXIT = 2  # bad config or input: one `error:` line
NONFINITE_EXIT = 3  # stopped on non-finite numbers (train.max_nonfinite_steps)
HANG_EXIT = 4
PREFLIGHT_EXIT = 5  # a node failed the preflight (trainer/preflight.py) and the job was not retried elsewhere
REQUEUE_EXIT = 75
INTERRUPTED_EXIT = 130  # a local launch stopped by Ctrl-C (128 + SIGINT)
CANCEL_EXIT = 140  # `slipway cancel`: USR2 to the batch shell (128 + SIGUSR2)
TERM_EXIT = 143  # SIGTERM to a job: a plain scancel, a preemption, the time limit (128 + SIGTERM)
EXIT_CODES = {
    0: "completed",
    1: "failed (a crash; torchrun reports 2 and 3 as 1)",
    BAD_INPUT_EXIT: "bad config or input (launcher: srun)",
    NONFINITE_EXIT: "stopped on non-finite numbers (launcher: srun)",
    HANG_EXIT: "hung, not retried",
    PREFLIGHT_EXIT: "a node failed its preflight, not retried",
    REQUEUE_EXIT: "saved a checkpoint and stopped after the time-limit warning, no requeue left",
    INTERRUPTED_EXIT: "a local launch stopped by Ctrl-C",
    CANCEL_EXIT: "cancelled by slipway cancel",
    TERM_EXIT: "SIGTERM: a plain `scancel`, a preemption, or the time limit without a save",
}
# Any other code above 128 is 128 + the signal that ended the launch (a rank, or a local launch's launcher).

LOCAL_JOB = "local"  # the job field of a launch on this machine
# The preflight's all-reduce in the training step (trainer/preflight.py AllReduceGate): the batch
# script asks for it with PREFLIGHT_ENV="MEGABYTES TIMEOUT_S"; a rank that fails it writes its
# one-line reason to PREFLIGHT_FAILED_FILE among the step's exit reports ($SLIPWAY_EXITS), which
# the batch script reads (job_lib.sh `after_preflight`).
PREFLIGHT_ENV = "SLIPWAY_PREFLIGHT_ALLREDUCE"
PREFLIGHT_FAILED_FILE = "preflight-failed"
# The code snapshot the ranks run (jobs/runs/code.py): its directory, set in their environment.
CODE_ENV = "SLIPWAY_CODE"

# The bash writer is the batch script's `event()` (jobs/slurm/job_lib.sh), one line of the same format:
#   event() { printf '%s job %s %s\n' "$(date --iso-8601=seconds)" "$SLURM_JOB_ID" "$*" >> "$RUN_DIR/events.log"; }
# tests/test_lifecycle.py runs it and reads its lines back with `parse_event`.


@dataclass(frozen=True)
class CodeSnapshot:
    """A run's code snapshot (jobs/runs/code.py takes it): its content hash, where it lives, and
    where the code came from. The manifest records it; the batch script and env.toml name `dir`."""

    hash: str
    dir: str  # absolute: RUNS/.code/HASH16
    files: int
    bytes: int
    source: str  # the trainer package it was taken from
    commit: Optional[str] = None  # the checkout's HEAD, when it is one
    dirty: Optional[bool] = None  # snapshotted files differ from that commit
    script: Optional[str] = None  # the train.script inside the snapshot (absolute)

    @property
    def hash12(self) -> str:
        return self.hash[:12]

    def record(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_record(cls, data: object) -> Optional["CodeSnapshot"]:
        if not isinstance(data, dict) or not isinstance(data.get("hash"), str) or not isinstance(data.get("dir"), str):
            return None
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values.setdefault("files", 0)
        values.setdefault("bytes", 0)
        values.setdefault("source", "")
        return cls(**values)

    def environment(self, pythonpath: Optional[str] = None) -> dict[str, str]:
        """What puts the snapshot in front of any installed `trainer` (`pythonpath`: one to keep behind it)."""
        # PYTHONSAFEPATH keeps the working directory out of sys.path, and with it a script's own
        # folder: the snapshot's copy of that folder follows the snapshot on the path instead.
        path = [self.dir, *([str(Path(self.script).parent)] if self.script else []), *([pythonpath] if pythonpath else [])]
        return {CODE_ENV: self.dir, "PYTHONPATH": ":".join(path), "PYTHONSAFEPATH": "1"}



def check_code(package_file: str, environ: Optional[dict] = None) -> Optional[str]:
    """Where the running `trainer` package comes from, against the snapshot the launch named
    ($SLIPWAY_CODE): None when it is the snapshot's (or none was named), else why not, in one line."""
    environ = os.environ if environ is None else environ
    code = environ.get(CODE_ENV)
    if not code:
        return None
    here = Path(package_file).resolve().parent
    if Path(code).resolve() / "trainer" == here:
        return None
    return (f"this process runs the trainer from {here}, not the run's code snapshot {code}/trainer "
            f"({CODE_ENV}): something ahead of PYTHONPATH shadows it (a `trainer` in the working directory "
            "with a Python older than 3.11, which ignores PYTHONSAFEPATH, or a .pth file); run from another "
            "directory or set code.snapshot: false")


class EventKind(str, enum.Enum):
    """What an event says, from the start of its text (the batch script's and the local launcher's words)."""

    START = "start"  # an attempt began: `start on NODES (restart N), ...`, `start on this machine`
    END = "end"  # an attempt ended: `end exit N`, `end interrupted`, `end signal NAME`
    PREPARE_START = "prepare start"
    PREPARE_END = "prepare end"
    RETRY = "retry"  # a failure retry: the job requeued itself
    NOT_RETRYING = "not retrying"  # a failure the job may not retry: it ends with the failure's code
    REQUEUE_FAILED = "requeue failed"
    TIME_LIMIT_WARNING = "time limit warning"
    TIME_LIMIT_REQUEUE = "time-limit requeue"
    TIME_LIMIT_STOP = "time-limit stop"  # saved at the warning, slurm.requeue off: the job ends REQUEUE_EXIT
    NOT_REQUEUEING = "not requeueing"  # the time-limit requeues are used up: the job ends REQUEUE_EXIT
    VERIFICATION_FAILED = "verification failed"  # what the job runs is not what was submitted: exit 2, no retry
    COMPILE_FALLBACK = "compile fallback"  # train.compile auto: the first step failed to compile, trained eagerly
    PREFLIGHT_OK = "preflight ok"
    PREFLIGHT_FAILED = "preflight failed"
    HANG = "hang"
    NODE_FAILURE = "node failure"
    CANCELLED = "cancelled"
    OTHER = "other"


# Longest prefix first where one starts another.
_KINDS: tuple[tuple[str, EventKind], ...] = (
    ("start on ", EventKind.START),
    ("end ", EventKind.END),
    ("prepare start", EventKind.PREPARE_START),
    ("prepare end", EventKind.PREPARE_END),
    ("retry ", EventKind.RETRY),
    ("not retrying", EventKind.NOT_RETRYING),
    ("requeue failed", EventKind.REQUEUE_FAILED),
    ("time limit warning", EventKind.TIME_LIMIT_WARNING),
    ("time-limit requeue", EventKind.TIME_LIMIT_REQUEUE),
    ("not requeueing", EventKind.NOT_REQUEUEING),
    ("time-limit stop", EventKind.TIME_LIMIT_STOP),
    ("verification failed", EventKind.VERIFICATION_FAILED),
    ("compile fallback", EventKind.COMPILE_FALLBACK),
    ("preflight ok", EventKind.PREFLIGHT_OK),
    ("preflight failed", EventKind.PREFLIGHT_FAILED),
    ("hang:", EventKind.HANG),
    ("node failure", EventKind.NODE_FAILURE),
    ("cancelled", EventKind.CANCELLED),
)
_EXIT = re.compile(r"end exit (-?\d+)\b")
_HANG_TAG = re.compile(r"hangs/(\S+)-\*\.txt")
_SIGNAL = re.compile(r"end signal (\S+)")


def event_kind(text: str) -> EventKind:
    for prefix, kind in _KINDS:
        if text.startswith(prefix):
            return kind
    return EventKind.OTHER


@dataclass(frozen=True)
class Event:
    """One line of events.log."""

    time: str  # as written (ISO 8601 with its offset); `when` parses it
    job: str  # a Slurm job id, LOCAL_JOB, or "" when the writer had none
    text: str

    @cached_property  # asked of every event by each reader: decided once
    def kind(self) -> EventKind:
        return event_kind(self.text)

    @property
    def when(self) -> Optional[datetime]:
        try:
            return datetime.fromisoformat(self.time)
        except ValueError:
            return None

    @property
    def exit_code(self) -> Optional[int]:
        """The code an END / PREPARE_END event gives; INTERRUPTED_EXIT for `end interrupted`;
        128+N for `end signal N` with a number; None where it gives none."""
        m = _EXIT.search(self.text)
        if m and self.kind in (EventKind.END, EventKind.PREPARE_END):
            return int(m.group(1))
        if self.kind is EventKind.END and self.text.startswith("end interrupted"):
            return INTERRUPTED_EXIT
        s = _SIGNAL.match(self.text)
        if s and self.kind is EventKind.END:
            name = s.group(1).rstrip(",;:")
            if name.isdigit():
                return 128 + int(name)
            import signal

            try:
                return 128 + int(signal.Signals[name if name.startswith("SIG") else f"SIG{name}"])
            except KeyError:
                return None
        return None

    @property
    def hang_tag(self) -> str:
        """The attempt whose stack dumps a HANG event names (hangs/TAG-*.txt); "" otherwise."""
        m = _HANG_TAG.search(self.text) if self.kind is EventKind.HANG else None
        return m.group(1) if m else ""

    def line(self) -> str:
        return f"{self.time} job {self.job} {self.text}"


CHECKPOINT_MARKER = "COMPLETE"
_CHECKPOINT_STEP = re.compile(r"^step-(\d+)$")


def checkpoint_complete(path: Path) -> bool:
    """The one rule for a whole checkpoint, for the trainer's loads and the host's resume checks:
    its marker (written last) and torch.distributed.checkpoint's .metadata are there."""
    return (path / CHECKPOINT_MARKER).is_file() and (path / ".metadata").is_file()


def complete_checkpoints(ckpt_dir: str | os.PathLike) -> list[int]:
    """The steps of the complete checkpoints in `ckpt_dir` (the trainer's `step-NNNNNN/`; the batch
    script's latest_checkpoint reads the same), ascending."""
    path = Path(ckpt_dir)
    if not path.is_dir():
        return []
    return sorted(int(m.group(1)) for p in path.iterdir()
                  if (m := _CHECKPOINT_STEP.match(p.name)) and p.is_dir() and checkpoint_complete(p))


def now_iso() -> str:
    """This moment as `date --iso-8601=seconds` writes it (UTC here; bash writes its local offset)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def format_event(job: Optional[str], text: str, when: Optional[datetime | str] = None) -> str:
    """The events.log line (with its newline) for `text` about `job`, as the bash `event()` writes it."""
    stamp = when if isinstance(when, str) else (when.isoformat(timespec="seconds") if when else now_iso())
    job_word = _one_line(job or "").replace(" ", "_")
    return f"{_one_line(stamp)} job {job_word} {_one_line(text)}\n"


def parse_event(line: str) -> Optional[Event]:
    """The event on one line of events.log; None for a line that is not one (torn, foreign, empty)."""
    line = line.rstrip("\r\n")
    stamp, sep, rest = line.partition(" job ")
    if not sep or not stamp or " " in stamp or not stamp[:1].isdigit():
        return None
    try:
        datetime.fromisoformat(stamp)
    except ValueError:
        return None
    # An empty job id (no SLURM_JOB_ID) leaves two spaces: the job is "" and the text follows.
    job, _, text = rest.partition(" ")
    text = text.strip()
    if not text:
        return None
    return Event(stamp, job, text)


def parse_events(text: str) -> list[Event]:
    return [e for line in text.splitlines() if (e := parse_event(line)) is not None]


def read_events(run_dir: str | os.PathLike) -> list[Event]:
    """Every event of a run directory, in the order written; [] before the first."""
    try:
        data = (Path(run_dir) / EVENTS_FILE).read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return []
    return parse_events(data.decode("utf-8", errors="replace"))


def tail_events(run_dir: str | os.PathLike, until: Callable[[Event], bool], block: int = 8192) -> list[Event]:
    """The last events of a run directory's events.log, in the order written: from the latest one
    for which `until` holds (every event when none does). The file is read backwards, a block at a
    time, so that a reader of the latest attempt reads no more of a long history."""
    try:
        f = open(Path(run_dir) / EVENTS_FILE, "rb")
    except (FileNotFoundError, NotADirectoryError):
        return []
    found: list[Event] = []  # newest first
    with f:
        pos, rest = f.seek(0, os.SEEK_END), b""
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            lines = (f.read(pos - start) + rest).split(b"\n")
            pos, block = start, block * 2
            rest = lines.pop(0) if start > 0 else b""  # maybe cut: read whole with the block before it
            for line in reversed(lines):
                event = parse_event(line.decode("utf-8", errors="replace"))
                if event is not None:
                    found.append(event)
                    if until(event):
                        return found[::-1]
    return found[::-1]


def append_event(run_dir: str | os.PathLike, job: Optional[str], text: str,
                 when: Optional[datetime | str] = None) -> Event:
    """Append one event to RUN/events.log: one write(2) of one whole line under O_APPEND, so
    concurrent writers (the batch script, several ranks, the host) never interleave inside a line."""
    line = format_event(job, text, when)
    fd = os.open(Path(run_dir) / EVENTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        data = line.encode()
        written = os.write(fd, data)
        while written < len(data):  # a short write (a signal, a full disk): finish the line
            written += os.write(fd, data[written:])
    finally:
        os.close(fd)
    stamp, _, rest = line.rstrip("\n").partition(" job ")
    job_word, _, said = rest.partition(" ")
    return Event(stamp, job_word, said)
