"""What a listing shows of a run, from one small record a run: runs/RUN/.listing.json.

A listing of ten thousand runs (`status`, a sweep's status, `compare`) reads no manifest and no
events.log: each run's `Facts` are kept with the identity (inode, size, mtime) of the files they
come from, stat'ed before they are read (a change between the two makes the record stale, never
wrong). A record missing, stale, damaged or newer is replaced by reading that run alone
(`from_files`), written again where the user may write: a cache trusted no further than its types.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, get_args, get_type_hints

from common.events import Event, parse_event
from common.fs import write_atomic
from common.rundir import RunDir
from jobs.runs import lifecycle
from jobs.runs.lifecycle import LaunchState
from jobs.runs.manifest import Launch, to_record
from jobs.runs.run import Run

FORMAT = 1
MAX_BYTES = 64 << 10  # a record is a few hundred bytes; a latest attempt's events a few KiB
# What a record keeps of a launch still to judge: lifecycle's inputs, not its pins (no listing shows
# them), each with its field's types (values are checked by type alone: thousands are read at once).
_KEPT = {name: get_args(kind) or (kind,) for name, kind in get_type_hints(Launch).items()
         if name in ("job_id", "kind", "local", "started", "ended", "pid", "trainer_pid", "host", "allocation",
                     "exit", "signal", "trainer_exit", "steps")}
_TRAIN = ("step", "loss", "tokens_per_s", "mfu")


@dataclass
class Facts:
    launches: int = 0
    job: str = ""  # the latest launch's id
    ended: Optional[LaunchState] = None  # the latest launch's end, where nothing can change it any more
    latest: Optional[Launch] = None  # else that launch and its latest attempt's events, to judge with Slurm's answer
    events: list[Event] = field(default_factory=list)
    said: str = ""  # the latest attempt's last event
    train: dict = field(default_factory=dict)  # the latest train record's step, loss, tokens/s, MFU
    eval: dict = field(default_factory=dict)  # the latest eval record's
    total: Optional[int] = None  # train.steps of the latest training launch


def _identity(path: str) -> Optional[list[int]]:
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns]


# The files' names in a run directory (common/rundir.py's), joined as strings: a listing stats
# forty thousand of them, and a Path costs more to make than the stat.
_NAMES = [getattr(RunDir(Path("/")), name).name for name in ("manifest", "events", "metrics", "listing")]


def facts(run: Run) -> Facts:
    """The run's listing facts: its record while its files are unchanged, else from them (ManifestError, OSError)."""
    base = os.fspath(run.dir) + os.sep
    where = [_identity(base + name) for name in _NAMES[:3]]
    if where[0] is None:
        return Facts()  # a sweep's point not written yet
    found = _read(base + _NAMES[3], where)
    if found is not None:
        return found
    found = from_files(run)
    if found.latest is None or not found.latest.local:
        with contextlib.suppress(OSError):  # a teammate's run, a full disk: read alone the next time too
            write_atomic(base + _NAMES[3], json.dumps(_encoded(found, where)), sync=False)
    return found


def from_files(run: Run) -> Facts:
    """The run's listing facts read from its manifest and the ends of its events.log and metrics.jsonl."""
    launches = run.launches()
    out = Facts(len(launches), train=_picked(run.last_metrics(), _TRAIN),
                eval=_picked(run.last_metrics("eval"), ("step", "eval_loss")))
    if launches:
        latest = out.latest = launches[-1]
        out.job, out.events = latest.id, lifecycle.last_attempt(run.events_of(latest))
        out.said = out.events[-1].text if out.events else ""
        out.total = run.total_steps(next((x for x in reversed(launches) if x.kind == "train"), None))
        if latest.local and latest.recorded or lifecycle.settled(latest, out.events):
            out.ended, out.latest = lifecycle.launch_state(latest, out.events), None
    return out


def _picked(record: Optional[dict], keys: tuple[str, ...]) -> dict:
    return {k: record[k] for k in keys if k in record} if record else {}


def _encoded(found: Facts, where: list) -> dict:
    out = {"format": FORMAT, "of": where, "launches": found.launches, "job": found.job, "said": found.said,
           "train": found.train, "eval": found.eval, "total": found.total}
    if found.ended is not None:
        out["ended"] = [found.ended.state, found.ended.exit_code, found.ended.reason]
    elif found.latest is not None:
        out["launch"] = {k: v for k, v in to_record(found.latest).items() if k in _KEPT}
        out["events"] = [e.line() for e in found.events]
    return out


_TYPES = {"launches": int, "job": str, "said": str, "train": dict, "eval": dict, "total": (int, type(None))}


def _read(path: str, where: list) -> Optional[Facts]:
    """The record at `path` where it holds, of its own types, the facts of the files as they are
    now; None otherwise. Read without following a link, nor blocking or reading on where it is
    no regular file (a FIFO gives nothing, a device or a huge file no JSON, a directory an error)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            record = json.loads(os.read(fd, MAX_BYTES))
        finally:
            os.close(fd)
        if record.get("format") != FORMAT or record.get("of") != where or \
                not all(isinstance(record[k], t) for k, t in _TYPES.items()):
            return None
        out = Facts(**{k: record[k] for k in _TYPES})
        if "ended" in record:
            state, code, reason = record["ended"]
            if not (isinstance(state, str) and isinstance(reason, str) and isinstance(code, (int, type(None)))):
                return None
            out.ended = LaunchState(state, code, reason)
        elif out.launches:  # to be judged again: the launch whole, as the manifest's reader takes it
            kept = record["launch"]
            if not all(type(value) in _KEPT[key] for key, value in kept.items()):  # an unknown key: KeyError
                return None
            out.latest = Launch(**kept)
            out.events = [e for line in record["events"] if (e := parse_event(line)) is not None]
        return out
    except (OSError, ValueError, RecursionError, TypeError, KeyError, AttributeError):  # garbled: the files tell
        return None
