"""`slipway logs` (and `submit --show-logs`): a run's job log, printed as the job wrote it, or
followed until the job ends."""

from __future__ import annotations

import codecs
import os
import re
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional, TextIO

from common.environ import as_typed
from common.errors import ConfigError, pasteable, shown
from common.fs import open_regular
from common.rundir import LOCAL_JOB
from jobs import runs, slurm
from jobs.runs import lifecycle
from jobs.runs.manifest import Launch


def job_arg(run: runs.Run, job_id: Optional[str], launches: Optional[list[Launch]] = None) -> Optional[str]:
    """--job checked: a Slurm job id or `local` (it names a log file and goes to squeue), one of the
    run's (what `slipway status RUN` lists), never another job's log or state shown as the run's."""
    if job_id is None:
        return None
    if job_id != LOCAL_JOB and not re.fullmatch(r"[0-9]{1,12}(_[0-9]{1,9})?", job_id):
        raise ConfigError("--job", f"{shown(job_id)} is not a Slurm job id: give one that slipway status RUN lists")
    launches = run.launches() if launches is None else launches
    ids = [*(x.id for x in launches if not x.local), *([LOCAL_JOB] if any(x.local for x in launches) else [])]
    if job_id not in ids:
        raise ConfigError("--job", f"run {run.name} has no job {job_id}: its jobs are {', '.join(ids[-5:]) or 'none yet'} "
                                   f"(`slipway status {pasteable(run.name)}` lists them)")
    return job_id


def show_logs(run: runs.Run, job_id: str | None, follow: bool, stream: str) -> int:
    launches = run.launches()
    if not launches:
        raise ConfigError("RUN", f"run {run.name} has no job yet: `slipway submit {shlex.quote(str(run.paths.config))}` "
                                 "submits it")
    job_id = job_arg(run, job_id, launches)
    if job_id == LOCAL_JOB or (job_id is None and launches[-1].local):
        return _show_local_log(run, [x for x in launches if x.local][-1], follow)
    job_id = job_id or launches[-1].id  # a Slurm job: the latest launch is no local one
    if follow:
        return follow_logs(run, job_id)
    path = run.log_path(job_id, stream)
    if not _Tail(path, sys.stdout, run).pump():
        info = slurm.job_info(job_id)
        raise ConfigError("RUN", f"no log yet at {path} (job {job_id} is {info.state if info else 'unknown'})")
    return 0


def _show_local_log(run: runs.Run, launch: Launch, follow: bool) -> int:
    """A local run's log (`make local` writes logs/local-STAMP.out); -f follows it while it runs."""
    path = run.dir / launch.log
    tail = _Tail(path, sys.stdout, run)
    if not launch.log or not tail.pump():
        raise ConfigError("RUN", f"no log at {path}")
    state = run.state(launch)
    while follow and not state.ended:
        time.sleep(1.0)
        tail.pump()
        launch = next((x for x in run.launches() if x.same(launch)), launch)
        state = run.state(launch)
    tail.pump()
    # as for a Slurm job: printing the log succeeds; following it ends with the launch's exit code
    return state.final_exit if follow else 0


class _Tail:
    """Follows one growing file from its start: opened only while it is a regular file (a FIFO
    or a device is one error line, never a hang) and copied a bounded chunk at a time, as the
    job wrote it (a log is the job's own output: `logs` is `cat`)."""

    CHUNK = 1 << 20

    def __init__(self, path: Path, out: TextIO, run: runs.Run):
        self.path, self.out, self.pos = path, out, 0
        self.text = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character cut by a chunk's end
        # The trainer's suggestions (`slipway prepare CONFIG`) with the run's config, as this shell runs
        # them: typed a whole line at a time (a hint is never cut by a chunk's end).
        self.config_args, self.partial = shlex.quote(str(run.paths.config)), ""
        self.ended = False  # the batch script's last line, how the job ended, was copied

    def pump(self) -> bool:
        """Copy what was added since the last pump; whether the file exists."""
        f = open_regular(self.path)
        if f is None:
            return False
        with f:
            if f.seek(0, os.SEEK_END) < self.pos:  # cut short or replaced: from its start again
                self.pos = 0
                self.text.reset()
            f.seek(self.pos)
            while chunk := f.read(self.CHUNK):
                self.pos += len(chunk)
                lines = (self.partial + self.text.decode(chunk)).split("\n")
                self.partial = lines.pop()
                self.out.write("".join(as_typed(line, self.config_args) + "\n" for line in lines))
                self.ended = self.ended or any(line.startswith("slipway: job ") and " ended: " in line for line in lines)
            if self.partial and not f.read(1):  # the file's last line, written whole so far
                self.out.write(as_typed(self.partial, self.config_args))
                self.partial = ""
            self.out.flush()
        return True


LAST_LINES_SECONDS = 90.0  # the curves' step's bound (jobs/slurm/script.py), and its container's start
POLL_SECONDS = 1.0
GONE_POLLS = 5  # polls without any record of the job before its end is read from events.log


class JobPoll:
    """A Slurm job's state, poll after poll, as `watch`, `logs -f` and `submit --show-logs` follow it:
    events.log's once it settles the end (Slurm no longer asked), else Slurm's, with its reason while
    the job is active (a job that cannot start says why: a node down, a hold, not a bare PENDING);
    where slurmctld forgot the job and there is no accounting, events.log's after GONE_POLLS polls."""

    def __init__(self, run: runs.Run, job_id: str):
        self.run, self.launch, self.gone = run, run.launch(job_id) or Launch(job_id=job_id), 0

    def __call__(self) -> tuple[lifecycle.LaunchState, Optional[slurm.JobInfo], bool]:
        """(the state, Slurm's record of the job if it was asked and has one, whether the job ended)."""
        own = self.run.events_of(self.launch)
        if lifecycle.settled(self.launch, own):
            return lifecycle.launch_state(self.launch, own), None, True
        if (info := slurm.job_info(self.launch.id)) is None:
            self.gone += 1
            ended = self.gone >= GONE_POLLS
            return lifecycle.launch_state(self.launch, own) if ended else lifecycle.LaunchState(lifecycle.UNKNOWN), None, ended
        self.gone = 0
        if info.active:
            return lifecycle.LaunchState(info.state, reason=info.reason), info, False
        return lifecycle.launch_state(self.launch, own, info), info, True


def follow_logs(run: runs.Run, job_id: str, on_state: Optional[Callable[[str], None]] = None) -> int:
    """Print the job's logs as they grow until it ends (their paths known before it starts: no line is
    missed); its exit code. `on_state` is told each new state (`JobPoll`)."""
    tails = [_Tail(run.log_path(job_id, "output"), sys.stdout, run)]  # the streams of now, not of import time
    if (err_path := run.log_path(job_id, "error")) != tails[0].path:
        tails.append(_Tail(err_path, sys.stderr, run))

    def pump() -> None:
        for t in tails:
            t.pump()

    poll, last_state = JobPoll(run, job_id), None
    while True:
        pump()
        state, info, ended = poll()
        shown = f"{state.state} ({state.reason})" if state.reason and not ended else state.state
        if shown != last_state and on_state:
            on_state(shown)
        last_state = shown
        if ended:
            # After its recorded end a job still writes its last lines (its curves, drawn in a
            # step of its own, then how it ended): followed while Slurm has it, for so long at most
            # after that end; an end recorded longer ago, or the log's last line, says they are written.
            end = lifecycle.final_end(lifecycle.last_attempt(run.events_of(poll.launch)))
            deadline = time.monotonic() + LAST_LINES_SECONDS - (
                (datetime.now(timezone.utc) - end.when).total_seconds() if end else LAST_LINES_SECONDS)
            while time.monotonic() < deadline and not tails[0].ended and getattr(slurm.job_info(job_id), "active", False):
                pump()
                time.sleep(POLL_SECONDS)
            time.sleep(POLL_SECONDS)  # the last lines may land just after the end
            pump()
            return lifecycle.launch_state(poll.launch, run.events_of(poll.launch), info).final_exit
        time.sleep(POLL_SECONDS)
