"""`slipway status`, `logs` and `cancel`: what became of a run's jobs."""

from __future__ import annotations

import sys
import time

from rich.markup import escape

from jobs import runs, slurm
from jobs.runs import lifecycle
from jobs.runs import lock as runlock
from jobs.runs.lifecycle import History, Launch
from kernel.errors import ConfigError
from kernel.rundir import HANGS_DIR
from kernel.rundir import LOCAL_JOB


def job_history(run: runs.Run, job_id: str) -> History:
    """What became of Slurm job `job_id` of `run` across its attempts (lifecycle.history)."""
    return lifecycle.history(job_id, run.events())


def hang_dumps(run: runs.Run, tag: str) -> list[str]:
    """One line per stack dump of attempt `tag`: rank, node, and whether it answered in time."""
    out = []
    for path in sorted((run.dir / HANGS_DIR).glob(f"{tag}-*.txt")):
        try:
            with path.open() as f:
                first = f.readline().split()
        except OSError:
            continue
        if len(first) >= 15 and first[:3] == ["slipway", "hang:", "rank"]:
            late = "late: frozen or starved until the teardown" if first[14] == "late" else "on time"
            out.append(f"rank {first[3]} on {first[5]}: {late} ({path.relative_to(run.dir)})")
    return out


def _progress(run: runs.Run) -> str:
    m = run.last_metrics()
    if not m:
        return ""
    loss = m.get("loss")
    try:
        total = run.config().train.steps
    except (ConfigError, OSError):
        total = None
    step = f"step {m.get('step')}" + (f"/{total}" if total else "")
    return step + (f", loss {loss:.3f}" if isinstance(loss, (int, float)) else "")


def _job_row(run: runs.Run, launch: Launch, events) -> tuple[str, str, str, str, str]:
    """(job, state, exit, elapsed, last event or reason) of one launch, as the tables show it."""
    own = run.events_of(launch, events)
    if launch.local:
        state = lifecycle.launch_state(launch, own, process=lifecycle.observe_local(launch))
        elapsed = lifecycle.elapsed(launch, state)
    else:
        info = slurm.job_info(launch.id) if slurm.available("scontrol") or slurm.available("sacct") else None
        state = lifecycle.launch_state(launch, own, info)
        elapsed = info.elapsed if info else ""
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
    """A note when the image the run's latest job used is not the current build for its config."""
    pinned = run.image()
    if pinned is None or pinned.source != "build":
        return None
    try:
        from containers.image import current_image

        current = current_image(run.config(), root=run.paths.project_dir)
    except (ConfigError, OSError):
        return None
    if current and current.hash != pinned.build_hash:
        return (f"image: this run uses build {str(pinned.build_hash)[:12]}, the current build is "
                f"{current.hash12} (a resubmission would use the current one)")
    return None


def show_status(project_dir, run_name: str | None, console) -> int:
    from rich import box
    from rich.table import Table

    if run_name:
        run = runs.find_run(run_name, project_dir)
        table = Table(title=f"run {run.name}  {_progress(run)}", title_justify="left")
        for col in ("job", "state", "exit", "elapsed", "last event / reason"):
            table.add_column(col)
        events = run.events()
        for launch in run.launches():
            table.add_row(*_job_row(run, launch, events))
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
    found = runs.list_runs(project_dir)
    if not found:
        console.print(f"no runs in {runs.runs_root(project_dir)}: `slipway submit CONFIG` makes one")
        return 0
    # No rules between columns and short headings: seven columns in 80, only the last event wrapping.
    table = Table(title=f"runs in {runs.runs_root(project_dir)}", title_justify="left", box=box.SIMPLE_HEAD,
                  show_edge=False, collapse_padding=True)
    for col in ("run", "jobs", "job", "state", "exit", "progress", "last event"):
        table.add_column(col, no_wrap=col != "last event", ratio=1 if col == "last event" else None)
    for run in found:
        launches = run.launches()
        if launches:
            job, state, code, _, event = _job_row(run, launches[-1], run.events())
        else:
            job, state, code, event = "", "not submitted", "", ""
        table.add_row(run.name, str(len(launches)), job, state, code, _progress(run), event)
    console.print(table)
    return 0


def _print_history(run: runs.Run, history: History, console) -> None:
    for line in history.lines():
        console.print(line, soft_wrap=True, highlight=False, markup=False)
    if history.hang:
        console.print(f"[red]hung[/] (attempt {escape(history.hang_tag)}): {escape(history.hang.removeprefix('hang: '))}",
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
        return runs.follow(run, job_id)
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
    tail = runs._Tail(path, sys.stdout)
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


# How long `slipway cancel` lets a job's batch script record its end and remove its containers
# (while the allocation still exists) before scancel ends it regardless.
CANCEL_GRACE_SECONDS = 90.0


def cancel(run: runs.Run, console) -> int:
    """USR2 to each job's batch shell first (jobs/slurm/job_lib.sh on_cancel: "cancelled by slipway
    cancel", end exit 140), then, for a job still there after a bounded wait, scancel. Under the
    run's lock: a submission in progress finishes first (and its job is cancelled too); a local
    launch that trains refuses, naming its launcher."""
    with runlock.hold(run.dir, f"slipway cancel {run.name}"):
        return _cancel(run, console)


def _cancel(run: runs.Run, console) -> int:
    active = [j for j in run.job_ids() if (info := slurm.job_info(j)) is not None and info.active]
    if not active:
        console.print(f"run {run.name} has no active job")
        return 0

    def still_active() -> list[str]:
        return [j for j in active if (i := slurm.job_info(j)) is not None and i.active]

    # A pending job has no batch shell to signal: scancel alone ends it.
    running = [j for j in active if (i := slurm.job_info(j)) is not None and i.state.split()[:1] == ["RUNNING"]]
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
    from kernel.rundir import append_event

    for job in jobs:
        append_event(run.dir, job, "cancelled by slipway cancel")
