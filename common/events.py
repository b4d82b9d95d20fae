"""events.log: one line per event of a run, the record every end is told in: `TIME job JOB TEXT`
(`date --iso-8601=seconds`; the Slurm job id, which survives requeues, or `local`; text whose start
says what happened: `EventKind`). Written by the batch script's `event()` (jobs/slurm/job_lib.sh) and
`append_event`; read through `parse_event`, which never fails on a torn or foreign line, at most the
last MAX_EVENTS_BYTES of a regular file. Stdlib only: the trainer writes here too.
"""

from __future__ import annotations

import enum
import os
import re
import signal
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path
from typing import Optional

from common.errors import one_line
from common.fs import append_line, read_tail
from common.rundir import INTERRUPTED_EXIT, RunDir

# What a reader takes of events.log at most, from its end: thousands of attempts' events (a line is
# about 120 bytes); a longer file is a runaway or hostile one.
MAX_EVENTS_BYTES = 4 << 20


class EventKind(str, enum.Enum):
    """What an event says: the start of its text (the batch script's and the local launcher's
    words), the longest first where one starts another; OTHER, last, any other."""

    START = "start on "  # an attempt began: `start on NODES (restart N), ...`, `start on this machine`
    END = "end "  # an attempt ended: `end exit N`, `end interrupted`, `end signal NAME`
    PREPARE_START = "prepare start"
    PREPARE_END = "prepare end"
    RETRY = "retry "  # a failure retry: the job requeued itself
    NOT_RETRYING = "not retrying"  # a failure the job may not retry: it ends with the failure's code
    REQUEUE_FAILED = "requeue failed"
    TIME_LIMIT_WARNING = "time limit warning"
    TIME_LIMIT_REQUEUE = "time-limit requeue"
    NOT_REQUEUEING = "not requeueing"  # the time-limit requeues are used up: the job ends REQUEUE_EXIT
    TIME_LIMIT_STOP = "time-limit stop"  # saved at the warning, slurm.requeue off: the job ends REQUEUE_EXIT
    VERIFICATION_FAILED = "verification failed"  # what the job runs is not what was submitted: exit 2, no retry
    PREFLIGHT_OK = "preflight ok"
    PREFLIGHT_FAILED = "preflight failed"
    HANG = "hang:"
    NODE_FAILURE = "node failure"
    RANK_FAILED = "rank failed:"  # `rank failed: rank R on NODE was killed by SIGKILL (exit 137)` / `exited N`
    CANCELLED = "cancelled"
    PREEMPTED = "preempted:"  # requeued by Slurm (a preemption, an `scontrol requeue`), said by the next attempt
    WARNING_LEAD = "warning lead "  # how long before the time limit the job asks for the save, and why
    OTHER = ""


_EXIT = re.compile(r"end exit (-?\d+)\b")
_HANG_TAG = re.compile(r"hangs/(\S+)-\*\.txt")
_SIGNAL = re.compile(r"end signal (\S+)")


_STARTS = tuple((kind.value, kind) for kind in EventKind if kind.value)  # an Enum's members are slow to walk


@dataclass(frozen=True)
class Event:
    """One line of events.log."""

    time: str  # as written (ISO 8601 with its offset); `when` parses it
    job: str  # a Slurm job id, LOCAL_JOB, or "" when the writer had none
    text: str

    @cached_property  # asked of every event by each reader: decided once
    def kind(self) -> EventKind:
        return next((kind for start, kind in _STARTS if self.text.startswith(start)), EventKind.OTHER)

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
        if self.text.startswith("end interrupted"):  # an END event, as is `end signal` below
            return INTERRUPTED_EXIT
        s = _SIGNAL.match(self.text)
        name = s.group(1).rstrip(",;:") if s else ""
        if name.isdigit():
            return 128 + int(name)
        number = signal.Signals.__members__.get(name if name.startswith("SIG") else f"SIG{name}")
        return None if number is None else 128 + int(number)

    @property
    def hang_tag(self) -> str:
        """The attempt whose stack dumps a HANG event names (hangs/TAG-*.txt); "" otherwise."""
        m = _HANG_TAG.search(self.text) if self.kind is EventKind.HANG else None
        return m.group(1) if m else ""

    def line(self) -> str:
        return f"{self.time} job {self.job} {self.text}"


def now_iso() -> str:
    """This moment as `date --iso-8601=seconds` writes it (UTC here; bash writes its local offset)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def format_event(job: Optional[str], text: str, when: Optional[datetime | str] = None) -> str:
    """The events.log line (with its newline) for `text` about `job`, as the bash `event()` writes it."""
    stamp = when if isinstance(when, str) else (when.isoformat(timespec="seconds") if when else now_iso())
    job_word = "_".join(one_line(job or "").split())
    return f"{'_'.join(one_line(stamp).split())} job {job_word} {' '.join(one_line(text).split())}\n"


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
    return Event(stamp, job, text.strip()) if text.strip() else None


def read_events(run_dir: str | os.PathLike) -> list[Event]:
    """The events of a run directory, in the order written; [] before the first. An events.log that is
    no regular file raises NotRegularFile; one the user may not read, PermissionError."""
    data = read_tail(RunDir(Path(run_dir)).events, MAX_EVENTS_BYTES)
    lines = [] if data is None else data.decode("utf-8", errors="replace").splitlines()
    return [e for line in lines if (e := parse_event(line)) is not None]


def append_event(run_dir: str | os.PathLike, job: Optional[str], text: str,
                 when: Optional[datetime | str] = None) -> None:
    """Append one event to RUN/events.log (`append_line`: concurrent writers never interleave in a line)."""
    append_line(RunDir(Path(run_dir)).events, format_event(job, text, when))
