"""`slipway status`, `logs` and `cancel`: what became of a run's jobs.

Each command asks Slurm once for all the launches it shows (lifecycle.ask_slurm: one squeue, one
sacct), and not at all for a launch whose end events.log settles; a listing of every run reads
only the end of each run's events.log and metrics.jsonl.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, TextIO

from rich.markup import escape

from jobs import runs, slurm
from jobs.runs import lifecycle
from jobs.runs import lock as runlock
from jobs.runs.lifecycle import History
from jobs.runs.manifest import Launch, ManifestError
from common.errors import ConfigError
from common.events import Event
from common.rundir import LOCAL_JOB, HangLine


def job_history(run: runs.Run, job_id: str) -> History:
    """What became of Slurm job `job_id` of `run` across its attempts (lifecycle.history)."""
    return lifecycle.history(job_id, run.events())


def hang_dumps(run: runs.Run, tag: str) -> list[str]:
    """One line per stack dump of attempt `tag`: rank, node, and whether it answered in time."""
    out = []
    for path in run.paths.hang_dumps(tag):
        line = HangLine.read(path)
        if line is not None:
            late = "on time" if line.on_time else "late: frozen or starved until the teardown"
            out.append(f"rank {line.rank} on {line.host}: {late} ({path.relative_to(run.dir)})")
    return out


def _progress(run: runs.Run, launches: Sequence[Launch]) -> str:
    m = run.last_metrics()
    if not m:
        return ""
    loss = m.get("loss")
    total = run.total_steps(next((x for x in reversed(launches) if x.kind == "train"), None))
    step = f"step {m.get('step')}" + (f"/{total}" if total else "")
    return step + (f", loss {loss:.3f}" if isinstance(loss, (int, float)) else "")


def _job_row(launch: Launch, own: Sequence[Event], info: Optional[slurm.JobInfo]) -> tuple[str, str, str, str, str]:
    """(job, state, exit, elapsed, last event or reason) of one launch, from its own events and
    what Slurm said of it (None: not asked, or it does not know the job), as the tables show it."""
    if launch.local:
        state = lifecycle.launch_state(launch, own, process=lifecycle.observe_local(launch))
    else:
        state = lifecycle.launch_state(launch, own, info)
    elapsed = lifecycle.elapsed(launch, state, own, info)
    code = "" if state.exit_code is None else str(state.exit_code)
    return (launch.id, state.state, code, elapsed, state.reason or (own[-1].text if own else ""))


def code_lines(run: runs.Run) -> list[str]:
    """The code the run's latest launch runs, and where it changed between launches."""
    code = run.code()
    history = run.code_history()
    if code is None:
        return ["code: the image's own (code.snapshot: false)"] if history else []
    where = f"commit {code.commit[:12]}" if code.commit else "not a git checkout"
    if code.dirty:
        diff = run.dir / "code" / f"{code.hash12}.diff"
        where += f", with uncommitted changes ({diff})" if diff.exists() else ", with uncommitted changes"
    out = [f"code {code.hash12} ({where}; snapshot {code.dir})"]
    changes = [(job, before, after) for (_, before), (job, after) in zip(history, history[1:])
               if (before.hash if before else None) != (after.hash if after else None)]
    for job, before, after in changes:
        was, now = (c.hash12 if c else "the image's code" for c in (before, after))
        out.append(f"note: code changed at {'the local launch' if job == LOCAL_JOB else 'job ' + job}: {was} -> {now}")
    return out


def image_drift(run: runs.Run) -> str | None:
    """A note when a resubmission of the run would run another build than its latest job did (a
    newer build of its config's image settings), or none at all."""
    pinned = run.image()
    if pinned is None or pinned.source != "build":
        return None
    from jobs.runs.container import build_of_settings

    try:
        now = build_of_settings(run.config(), run.paths.project)
    except ConfigError as exc:
        return f"image: a resubmission would be refused: {exc}"
    except OSError:
        return None
    if now.hash != pinned.build_hash:
        return (f"image: this run uses build {str(pinned.build_hash)[:12]}; a resubmission would run "
                f"{now.hash12}, the newest build of its config's image settings")
    return None


def show_status(project_dir, run_name: str | None, console) -> int:
    from rich.table import Table

    if run_name:
        run = runs.find_run(run_name, project_dir)
        launches = run.launches()
        events = run.events()
        owns = [run.events_of(x, events) for x in launches]
        answers = lifecycle.ask_slurm(zip(launches, owns))
        table = Table(title=f"run {run.name}  {_progress(run, launches)}", title_justify="left")
        for col in ("job", "state", "exit", "elapsed", "last event / reason"):
            table.add_column(col)
        for launch, own in zip(launches, owns):
            table.add_row(*_job_row(launch, own, answers.get(launch.id)))
        console.print(table)
        latest = run.latest_train_job()
        if latest:
            _print_history(run, job_history(run, latest), console)
        image = run.image()
        if image is not None and image.image:
            console.print(f"image {image.image}" + (f" (build {image.build_hash[:12]})" if image.build_hash else ""),
                          soft_wrap=True, highlight=False)
        for line in code_lines(run):
            console.print(line, soft_wrap=True, highlight=False)
        drift = image_drift(run)
        if drift:
            console.print(f"[yellow]note:[/] {drift}", soft_wrap=True)
        return 0
    return _show_runs(project_dir, console)


LISTING = ("run", "jobs", "latest", "state", "exit", "progress", "last event")  # short: seven columns in 80
_CONTROL = {c: "?" for c in [*range(32), 127]}  # a cell is one line on the terminal, whatever a file held


def _listing(title: str, rows: list[tuple[str, ...]], width: Optional[int] = None) -> str:
    """Rows under LISTING's heads, columns as wide as their widest cell and the last one what is
    left of `width` (cut short; on a line of its own below its row when too little is left; whole
    without a width: into a pipe). Plain text, as rich's tables take half a millisecond a row and a
    project may hold ten thousand runs."""
    rows = [LISTING, *[tuple(c.translate(_CONTROL) for c in row) for row in rows]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(LISTING) - 1)]
    lines = []
    for row in rows:
        head = "  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  "
        last = row[-1]
        room = None if width is None else width - len(head)
        if room is None or len(last) <= room:
            lines.append(head + last)
        elif room >= 16:
            lines.append(head + last[:room - 3] + "...")
        else:  # the last event below its row, indented, as much of it as fits
            lines += [head.rstrip(), "    " + (last if len(last) <= width - 4 else last[:width - 7] + "...")]
    return "\n".join([title[:width] if width else title, *(line.rstrip() for line in lines)]) + "\n"


def _width() -> Optional[int]:
    """The terminal's width ($COLUMNS first); None into a pipe or a file, where nothing is cut."""
    import os
    import shutil

    if os.environ.get("COLUMNS", "").isdigit():
        return max(40, int(os.environ["COLUMNS"]))
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None


def _show_runs(project_dir, console) -> int:
    """Every run: its latest launch's state, from the end of its events.log and one Slurm query for all."""
    found = runs.list_runs(project_dir)
    if not found:
        console.print(f"no runs in {runs.runs_root(project_dir)}: `slipway submit CONFIG` makes one")
        return 0
    damaged: list[ManifestError] = []
    shown: list[tuple[runs.Run, list[Launch], list[Event], Optional[ManifestError]]] = []
    for run in found:
        try:
            launches = run.launches()
        except ManifestError as exc:  # that run alone: the others are listed
            damaged.append(exc)
            shown.append((run, [], [], exc))
            continue
        shown.append((run, launches, run.recent_events(launches[-1]) if launches else [], None))
    answers = lifecycle.ask_slurm((launches[-1], own) for _, launches, own, _ in shown if launches)
    rows = []
    for run, launches, own, error in shown:
        if error is not None:
            rows.append((run.name, "", "", "DAMAGED", "", "", f"{run.paths.manifest.name}: {error.why}"))
        elif launches:
            job, state, code, _, event = _job_row(launches[-1], own, answers.get(launches[-1].id))
            rows.append((run.name, str(len(launches)), job, state, code, _progress(run, launches), event))
        else:
            rows.append((run.name, "0", "", "not submitted", "", "", ""))
    console.file.write(_listing(f"runs in {runs.runs_root(project_dir)}", rows, _width()))
    for exc in damaged:
        print(f"slipway: error: {exc}", file=sys.stderr)
    return 2 if damaged else 0


def _print_history(run: runs.Run, history: History, console) -> None:
    for line in history.lines():
        console.print(line, soft_wrap=True, highlight=False, markup=False)
    if history.hang:
        attempt = f"attempt {history.hang_attempt} of job {history.job_id}" if history.hang_attempt else f"job {history.job_id}"
        console.print(f"[red]hung[/] ({escape(attempt)}): {escape(history.hang.removeprefix('hang: '))}",
                      soft_wrap=True, highlight=False)
        for line in hang_dumps(run, history.hang_tag):
            console.print(f"  {line}", soft_wrap=True, highlight=False, markup=False)
    if history.preflight:
        console.print(f"preflight: {history.preflight.removeprefix('preflight ')}", soft_wrap=True,
                      highlight=False, markup=False)


def show_logs(run: runs.Run, job_id: str | None, follow: bool, stream: str) -> int:
    launches = run.launches()
    if not launches:
        raise ConfigError("RUN", f"run {run.name} has no job yet: `slipway submit` it first")
    if job_id is None and launches[-1].local:
        return _show_local_log(run, launches[-1], follow)
    job_id = job_id or next((x.id for x in reversed(launches) if not x.local), None)
    if job_id is None:
        raise ConfigError("--job", f"run {run.name} has no Slurm job")
    if follow:
        return follow_logs(run, job_id)
    path = run.log_path(job_id, stream)
    if not path.exists():
        info = slurm.job_info(job_id)
        state = info.state if info else "unknown"
        raise ConfigError("RUN", f"no log yet at {path} (job {job_id} is {state})")
    with path.open("rb") as f:
        sys.stdout.buffer.write(f.read())
    return 0


def _show_local_log(run: runs.Run, launch: Launch, follow: bool) -> int:
    """A local run's log (`make local` writes logs/local-STAMP.out); -f follows it while it runs."""
    path = run.dir / launch.log
    if not launch.log or not path.is_file():
        raise ConfigError("RUN", f"no log at {path}")
    tail = _Tail(path, sys.stdout)
    tail.pump()
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
    """Follows one growing file from its start."""

    def __init__(self, path: Path, out: TextIO):
        self.path, self.out, self.pos = path, out, 0

    def pump(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(self.pos)
                chunk = f.read()
        except FileNotFoundError:
            return
        if chunk:
            self.pos += len(chunk)
            self.out.write(chunk.decode(errors="replace"))
            self.out.flush()


def follow_logs(run: runs.Run, job_id: str, *, interval: float = 1.0,
                on_state: Optional[Callable[[str], None]] = None, out: TextIO = sys.stdout,
                err: TextIO = sys.stderr) -> int:
    """Print job `job_id`'s output and error logs as they grow until the job ends; its exit code.

    The log paths are known before the job starts, so nothing can be missed between submission
    and the first line. Slurm is asked once a poll, and no more once events.log settles the end.
    """
    tails = [_Tail(run.log_path(job_id, "output"), out)]
    err_path = run.log_path(job_id, "error")
    if err_path != tails[0].path:
        tails.append(_Tail(err_path, err))
    launch = run.launch(job_id) or Launch(job_id=job_id)
    last_state = None
    gone = 0
    while True:
        for t in tails:
            t.pump()
        own = run.events_of(launch)
        settled = lifecycle.settled(launch, own)
        info = None if settled else slurm.job_info(job_id)
        if settled:
            state = lifecycle.launch_state(launch, own).state
        else:
            state = info.state if info else "UNKNOWN"
        if state != last_state and on_state:
            on_state(state)
        last_state = state
        if settled or (info is not None and not info.active):
            time.sleep(interval)  # the last lines may land just after the end
            for t in tails:
                t.pump()
            return lifecycle.launch_state(launch, run.events_of(launch), info).final_exit
        if info is None:
            gone += 1
            if gone > 5:  # slurmctld forgot the job and there is no accounting: events.log tells
                for t in tails:
                    t.pump()
                return run.state(launch, ask_slurm=False).final_exit
        time.sleep(interval)


# How long `slipway cancel` lets a job's batch script record its end and remove its containers
# (while the allocation still exists) before scancel ends it regardless.
CANCEL_GRACE_SECONDS = 90.0


def cancel(run: runs.Run, console) -> int:
    """USR2 to each job's batch shell first (jobs/slurm/job_lib.sh on_cancel: "cancelled by slipway
    cancel", end exit 140), then, for a job still there after a bounded wait, scancel. Under the
    run's lock: a submission in progress finishes first (and its job is cancelled too); a local
    launch that trains refuses, naming its launcher."""
    with runlock.hold(run.dir, f"slipway cancel {run.name}"):
        try:
            launches = run.launches()
        except ManifestError as exc:
            raise exc.restated("slipway cannot tell which jobs of the run to cancel",
                               f"`squeue --name {run.name},{run.name}-prepare` lists the jobs of the run's name: "
                               "`scancel` them by id, then restore the file or move the run directory aside") \
                from None
        return _cancel(run, launches, console)


def _cancel(run: runs.Run, launches: list[Launch], console) -> int:
    events = run.events()
    answers = lifecycle.ask_slurm((x, run.events_of(x, events)) for x in launches if not x.local)
    active = [j for j, info in answers.items() if info.active]
    if not active:
        console.print(f"run {run.name} has no active job")
        return 0

    def still_active() -> list[str]:
        return [j for j, info in slurm.jobs_info(active).items() if info.active]

    # A pending job has no batch shell to signal: scancel alone ends it.
    running = [j for j in active if answers[j].state.split()[:1] == ["RUNNING"]]
    if running:
        slurm.scancel(running, "USR2", batch=True)
        deadline = time.time() + CANCEL_GRACE_SECONDS
        while time.time() < deadline and still_active():
            time.sleep(0.5)
    left = still_active()
    if left:
        slurm.scancel(left)
        _cancel_events(run, [j for j in left if j not in running])
    deadline = time.time() + 30
    while time.time() < deadline and still_active():
        time.sleep(0.5)
    console.print(f"cancelled {', '.join(active)}")
    return 0


def _cancel_events(run: runs.Run, jobs: list[str]) -> None:
    """The jobs without a batch shell to say so themselves (pending ones): cancel says it."""
    from common.events import append_event

    for job in jobs:
        append_event(run.dir, job, "cancelled by slipway cancel")
