"""A run's lifecycle on the host: its launches, their events, and what became of each.

A launch is a Slurm job (a series of attempts under one id, through failure retries and
time-limit requeues) or a launch on this machine: the manifest records it (`Launch`), events.log
tells what happened to it, and one function, `launch_state`, turns both and what Slurm or the
local processes say into its state, exit code and reason. `status`, `watch` and `logs -f` read
a run through here.
"""

from __future__ import annotations

import re
import signal
import socket
from dataclasses import dataclass, field
from datetime import datetime
from typing import Iterable, Optional, Sequence

from jobs import slurm
from jobs.runs.manifest import Launch
from jobs.slurm import ACTIVE_STATES, JobInfo
from jobs.slurm.bad_nodes import aware_time
from common.events import Event, EventKind
from common.fs import pid_alive
from common.rundir import HANG_EXIT, INTERRUPTED_EXIT, LOCAL_JOB, PREFLIGHT_EXIT, REQUEUE_EXIT

# The states `launch_state` gives an ended launch, beside Slurm's own words for one that is not.
RUNNING = "RUNNING"
COMPLETED, FAILED, HUNG, CANCELLED = "COMPLETED", "FAILED", "HUNG", "CANCELLED"
TIMEOUT, NODE_FAIL, PREFLIGHT_FAILED = "TIMEOUT", "NODE_FAIL", "PREFLIGHT_FAILED"
PREEMPTED = "PREEMPTED"  # Slurm preempted it and did not requeue it
STOPPED = "STOPPED"  # saved a checkpoint and stopped, to be resumed (exit REQUEUE_EXIT, not requeued)
INTERRUPTED = "INTERRUPTED"  # a local launch stopped by Ctrl-C
TERMINATED = "TERMINATED"  # a local launch ended by another signal
DIED = "DIED"  # a local launch whose processes are gone without recording an exit
UNKNOWN = "UNKNOWN"  # no word from Slurm or the launcher, no end in events.log

# Events that end an attempt badly (the batch script's words, jobs/slurm/script.py).
FAILURE_KINDS = frozenset({EventKind.HANG, EventKind.PREFLIGHT_FAILED, EventKind.NODE_FAILURE, EventKind.VERIFICATION_FAILED,
                           EventKind.NOT_RETRYING, EventKind.NOT_REQUEUEING, EventKind.REQUEUE_FAILED,
                           EventKind.RANK_FAILED})
# Slurm's words for a job not ended yet; its own STOPPED (SIGSTOPped, holding its nodes) is told as
# SUSPENDED, as STOPPED here is a launch that saved and ended.
_ACTIVE = (ACTIVE_STATES - {STOPPED}) | {"SUSPENDED"}
STARTS = (EventKind.START, EventKind.PREPARE_START)
_ENDS = (EventKind.END, EventKind.PREPARE_END)


def events_of(launch: Launch, events: Sequence[Event], runs_launches: Sequence[Launch] = ()) -> list[Event]:
    """The events of `launch`: its job id's; a local launch's from its start to the next local one's."""
    if not launch.local:
        return [e for e in events if e.job == launch.id]
    start = aware_time(launch.started)
    later = [w for x in runs_launches if x.local and (w := aware_time(x.started)) and start and w > start]
    until = min(later) if later else None

    def inside(when: Optional[datetime]) -> bool:
        return (start is None or (when is not None and when >= start)) and not (until and when and when >= until)

    return [e for e in events if e.job == LOCAL_JOB and inside(aware_time(e.time))]


def last_attempt(events: Sequence[Event]) -> list[Event]:
    """The events of a job's latest attempt: from its last start on (all of them before any start)."""
    starts = [i for i, e in enumerate(events) if e.kind in STARTS]
    return list(events[starts[-1]:]) if starts else list(events)


@dataclass(frozen=True)
class LocalProcess:
    """What this machine says of a local launch's processes: None where it cannot tell (another host)."""

    launcher_alive: Optional[bool] = None
    trainer_alive: Optional[bool] = None

    @property
    def alive(self) -> Optional[bool]:
        seen = [a for a in (self.launcher_alive, self.trainer_alive) if a is not None]
        return any(seen) if seen else None


def observe_local(launch: Launch) -> LocalProcess:
    """Look at a local launch's processes (only on the host that ran it: pids mean nothing elsewhere)."""
    if not launch.pid or launch.host != socket.gethostname():
        return LocalProcess()
    return LocalProcess(pid_alive(launch.pid), pid_alive(launch.trainer_pid) if launch.trainer_pid else None)


@dataclass(frozen=True)
class LaunchState:
    """What became of a launch: its state, exit code (None while it runs or nothing says) and why."""

    state: str
    exit_code: Optional[int] = None
    reason: str = ""
    hang_tag: str = ""  # HUNG: the attempt whose stack dumps are hangs/TAG-*.txt

    @property
    def ended(self) -> bool:
        return self.state != UNKNOWN and self.state.split()[0] not in _ACTIVE

    @property
    def final_exit(self) -> int:
        """The code to exit with once it ended: its own, else 0 for a completion and 1 for anything else."""
        return self.exit_code if self.exit_code is not None else 0 if self.state == COMPLETED else 1


def launch_state(launch: Launch, events: Sequence[Event], info: Optional[JobInfo] = None,
                 process: Optional[LocalProcess] = None) -> LaunchState:
    """The state of `launch` from its own events and Slurm's record (`info`, None: forgotten) or its processes; pure."""
    attempt = last_attempt(events)
    if launch.local:
        return _local_state(launch, attempt, process or LocalProcess())
    return _slurm_state(attempt, info)


def observed_state(launch: Launch, events: Sequence[Event], info: Optional[JobInfo] = None) -> LaunchState:
    """`launch_state`, a local launch's processes looked at (`observe_local`)."""
    return launch_state(launch, events, info, observe_local(launch) if launch.local else None)


def _last(attempt: Sequence[Event], *kinds: EventKind) -> Optional[Event]:
    return next((e for e in reversed(attempt) if e.kind in kinds), None)


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _by_code(code: int, attempt: Sequence[Event], reason: str) -> LaunchState:
    """An ended attempt classified by its exit code (as the batch script or launcher gives it) and events."""
    hang = _last(attempt, EventKind.HANG)
    if code == 0:
        return LaunchState(COMPLETED, 0, reason)
    if code == REQUEUE_EXIT:
        stop = _last(attempt, EventKind.TIME_LIMIT_STOP, EventKind.NOT_REQUEUEING)
        return LaunchState(STOPPED, code, stop.text if stop else reason or "saved a checkpoint and stopped")
    # The batch script exits these only after saying why in events.log; a user's command exiting 4 failed.
    if code == HANG_EXIT and hang is not None:
        return LaunchState(HUNG, code, hang.text, hang.hang_tag)
    preflight = _last(attempt, EventKind.PREFLIGHT_FAILED)
    if code == PREFLIGHT_EXIT and preflight is not None:
        return LaunchState(PREFLIGHT_FAILED, code, preflight.text)
    node = _last(attempt, EventKind.NODE_FAILURE)
    if node is not None:
        return LaunchState(NODE_FAIL, code, node.text)
    failure = _last(attempt, *FAILURE_KINDS)
    return LaunchState(FAILED, code, failure.text if failure else reason)


def final_end(attempt: Sequence[Event]) -> Optional[Event]:
    """The end the job recorded for its last attempt; None while it runs or if it requeued itself (more to come)."""
    end = _last(attempt, *_ENDS)
    if end is None:
        return None
    requeue = _last(attempt, EventKind.RETRY, EventKind.TIME_LIMIT_REQUEUE, EventKind.REQUEUE_FAILED)
    return end if requeue is None or requeue.kind is EventKind.REQUEUE_FAILED else None


def settled(launch: Launch, events: Sequence[Event]) -> bool:
    """Whether events.log (`events`: the launch's own) settles how a Slurm job ended, so that Slurm
    need not be asked: its last attempt recorded its end and did not requeue itself. A SIGTERM does
    not: only Slurm tells a plain scancel from a time limit or preemption that requeues the job."""
    attempt = last_attempt(events)
    if launch.local or final_end(attempt) is None:
        return False
    cancel = _last(attempt, EventKind.CANCELLED)
    return cancel is None or cancel.text.startswith("cancelled by slipway")


def ask_slurm(launches: Iterable[tuple[Launch, Sequence[Event]]]) -> dict[str, JobInfo]:
    """What Slurm says of the launches events.log does not settle: one squeue and one sacct at most."""
    ids = [x.id for x, own in launches if not x.local and not settled(x, own)]
    return slurm.jobs_info(ids) if ids else {}  # {} where neither squeue nor sacct is here


def _slurm_state(attempt: Sequence[Event], info: Optional[JobInfo]) -> LaunchState:
    last_text = attempt[-1].text if attempt else ""
    cancelled = _last(attempt, EventKind.CANCELLED)
    end = _last(attempt, *_ENDS)
    end_code = end.exit_code if end else None
    if info is not None and info.active:
        word = info.state.split()[0]
        return LaunchState("SUSPENDED" if word == STOPPED else word, None, info.reason or last_text)
    if info is None:  # slurmctld forgot the job and there is no accounting: events.log alone tells
        if cancelled is not None:
            return LaunchState(CANCELLED, end_code, cancelled.text)
        if end is None:
            return LaunchState(UNKNOWN, None, last_text)
        requeue = _last(attempt, EventKind.RETRY, EventKind.TIME_LIMIT_REQUEUE)
        if requeue is not None and end_code == 0:  # it requeued itself; no word of the next attempt
            return LaunchState(UNKNOWN, None, requeue.text)
        if end_code is None:
            return LaunchState(FAILED, None, end.text)
        return _by_code(end_code, attempt, last_text)
    word = info.state.split()[0] if info.state else UNKNOWN
    # One exit code per end (common/rundir.py's *_EXIT): the batch script's. Slurm's tells only an end
    # the script could not record (killed outright): after a plain scancel the script records 143
    # while Slurm, which SIGKILLs its cleanup KillWait seconds later, says 0:9.
    final = final_end(attempt)
    recorded = final.exit_code if final is not None else None
    code = recorded if recorded is not None else info.return_code
    if word in ("TIMEOUT", "DEADLINE"):  # the time limit's SIGTERM reads as a cancellation in events.log
        return LaunchState(TIMEOUT, code, info.reason or "the time limit was reached")
    if word == "CANCELLED" or cancelled is not None:
        by = info.state.partition(" ")[2]
        return LaunchState(CANCELLED, code, cancelled.text if cancelled else f"cancelled {by}".strip())
    if word == "NODE_FAIL":
        node = _last(attempt, EventKind.NODE_FAILURE)
        return LaunchState(NODE_FAIL, code, node.text if node else info.reason or "a node of the job failed")
    if word == "PREEMPTED":
        return LaunchState(PREEMPTED, code, f"preempted by Slurm{': ' + info.reason if info.reason else ''}")
    if word in ("OUT_OF_MEMORY", "BOOT_FAIL"):
        return LaunchState(FAILED, code, f"{word.lower().replace('_', ' ')}" + (f": {info.reason}" if info.reason else ""))
    if code is None:
        code = 0 if word == "COMPLETED" else 1
    return _by_code(code, attempt, info.reason or last_text)


def _local_state(launch: Launch, attempt: Sequence[Event], process: LocalProcess) -> LaunchState:
    end = _last(attempt, EventKind.END)
    last_text = attempt[-1].text if attempt else ""
    if launch.interrupted:
        return LaunchState(INTERRUPTED, INTERRUPTED_EXIT, "Ctrl-C")
    if launch.signal_number is not None:
        sig = launch.signal_number
        return LaunchState(INTERRUPTED if sig == signal.SIGINT else TERMINATED, 128 + sig,
                           f"stopped by {signal_name(sig)}")
    code = launch.recorded_exit
    if code is None and process.alive:
        return LaunchState(RUNNING, None, last_text)
    if code is None and end is not None:  # the launcher wrote its end event, not yet (or never) the manifest
        code = end.exit_code
        if code is None:
            return LaunchState(FAILED, None, end.text)
    if code is None:
        if process.alive is False:
            return LaunchState(DIED, None, "its processes are gone and it recorded no end (killed?)")
        return LaunchState(UNKNOWN, None, f"launched on {launch.host or 'another machine'}")
    if launch.allocation:  # the batch script's own end: its events say why (a rank's signal is no stop of ours)
        cancelled = _last(attempt, EventKind.CANCELLED)
        if cancelled is not None and code != 0:
            return LaunchState(CANCELLED, code, cancelled.text)
        return _by_code(code, attempt, last_text)
    sig = -code if code < 0 else code - 128 if 128 < code < 128 + 65 else None  # Popen's -N, a shell's 128+N
    if sig is not None and code != HANG_EXIT:
        if sig == signal.SIGINT:
            return LaunchState(INTERRUPTED, 128 + sig, "Ctrl-C")
        return LaunchState(TERMINATED, 128 + sig, f"stopped by {signal_name(sig)}")
    return _by_code(code, attempt, last_text)


def elapsed(launch: Launch, state: LaunchState, events: Sequence[Event] = (), info: Optional[JobInfo] = None,
            now: Optional[datetime] = None) -> str:
    """How long a launch ran (until now while it runs), as [D-]HH:MM:SS: a local launch by its
    manifest record; a Slurm job's last attempt, as Slurm's Elapsed counts it, by its own start and
    end events, else Slurm's figure (`info`); empty when nothing says (a launch that died)."""
    if launch.local:
        start, end = aware_time(launch.started), aware_time(launch.ended)
        running = state.state == RUNNING
    else:
        attempt = last_attempt(events)
        began, ended = _last(attempt, *STARTS), _last(attempt, *_ENDS)
        start = aware_time(began.time) if began else None
        end = aware_time(ended.time) if ended else None
        running = not state.ended
        if start is None or (running and info is not None) or (end is None and not running):
            return info.elapsed if info else ""
    if start is None or (end is None and not running):
        return ""
    if end is None:
        end = now or datetime.now(start.tzinfo)
    seconds = max(0, int((end - start).total_seconds()))
    days, rest = divmod(seconds, 86400)
    clock = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{clock}" if days else clock


@dataclass
class History:
    """What became of one Slurm job across its attempts, from its events."""

    job_id: str
    attempts: int = 0
    retries: list[str] = field(default_factory=list)  # the retry events' texts
    max_retries: Optional[int] = None
    requeues: int = 0
    max_requeues: Optional[int] = None
    excluded: str = ""
    last_failure: str = ""
    hang: str = ""
    hang_tag: str = ""  # the attempt whose stack dumps the last hang names (hangs/TAG-*.txt)
    hang_attempt: int = 0  # its number among the job's attempts (1: the first)
    preflight: str = ""  # the last preflight result (its bandwidth when it passed)
    preemptions: int = 0  # attempts Slurm requeued (a preemption, an scontrol requeue), apart from the others
    lead: str = ""  # the last warning lead the job said, and why

    def lines(self) -> list[str]:
        out = []
        if self.retries or self.requeues or self.preemptions or self.attempts > 1:
            kinds = ", ".join(re.sub(r"^retry \S+ \(([^)]*)\).*", r"\1", r) for r in self.retries)
            out.append(f"job {self.job_id}: {self.attempts} attempt(s); failure retries {len(self.retries)}"
                       f"{'/' + str(self.max_retries) if self.max_retries is not None else ''}"
                       f"{' (' + kinds + ')' if kinds else ''}; time-limit requeues {self.requeues}"
                       f"{'/' + str(self.max_requeues) if self.max_requeues is not None else ''}"
                       f"; preemptions {self.preemptions}"
                       f"{'; excluded nodes ' + self.excluded if self.excluded else ''}")
        if self.last_failure and self.last_failure != self.hang:  # the hang has lines of its own
            out.append(f"last failure: {self.last_failure}")
        if self.lead:
            out.append(f"time-limit {self.lead}")
        return out


def history(job_id: str, events: Sequence[Event]) -> History:
    h = History(job_id)
    for e in (e for e in events if e.job == job_id):
        kind = e.kind
        if kind is EventKind.START:
            h.attempts += 1
            m = re.search(r"failure retries \d+/(\d+), time-limit requeues \d+/(\d+)", e.text)
            if m:
                h.max_retries, h.max_requeues = int(m.group(1)), int(m.group(2))
        elif kind is EventKind.RETRY:
            h.retries.append(e.text)
            m = re.search(r"\(excluded nodes: ([^)]*)\)$", e.text)
            if m:
                h.excluded = m.group(1)
        elif kind is EventKind.TIME_LIMIT_REQUEUE:
            h.requeues += 1
        elif kind is EventKind.PREEMPTED:
            h.preemptions += 1
        elif kind is EventKind.WARNING_LEAD:
            h.lead = e.text
        elif kind in (EventKind.PREFLIGHT_OK, EventKind.PREFLIGHT_FAILED):
            h.preflight = e.text
        if kind in FAILURE_KINDS:
            h.last_failure = e.text
        if kind is EventKind.HANG:
            h.hang, h.hang_tag, h.hang_attempt = e.text, e.hang_tag, h.attempts
    return h
