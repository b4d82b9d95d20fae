"""`slipway status`, `logs` and `cancel`: what became of a run's jobs."""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from rich.markup import escape

from jobs import runs, slurm
from trainer.config import HANGS_DIR, ConfigError


def _last_event(run: runs.Run, job_id: str | None) -> str:
    for line in reversed(run.events()):
        parts = line.split(maxsplit=3)
        if len(parts) == 4 and (job_id is None or parts[2] == job_id):
            return parts[3]
    return ""


# Event texts the batch script writes (jobs/sbatch.py) that end an attempt badly.
FAILURES = ("hang:", "preflight failed", "node failure:", "not retrying", "not requeueing")


@dataclass
class History:
    """What became of one job across its attempts, from events.log: the failure retries and
    time-limit requeues it used (of how many), the nodes excluded, the last failure, the last hang."""

    job_id: str
    attempts: int = 0
    retries: list[str] = field(default_factory=list)  # the retry events' texts
    max_retries: Optional[int] = None
    requeues: int = 0
    max_requeues: Optional[int] = None
    excluded: str = ""
    last_failure: str = ""
    hang: str = ""
    preflight: str = ""  # the last preflight result (its bandwidth when it passed)

    @property
    def hang_tag(self) -> str:
        """The attempt whose stack dumps the last hang names (hangs/TAG-*.txt)."""
        m = re.search(r"hangs/(\S+)-\*\.txt", self.hang)
        return m.group(1) if m else ""

    def lines(self) -> list[str]:
        out = []
        if self.retries or self.requeues or self.attempts > 1:
            kinds = ", ".join(re.sub(r"^retry \S+ \(([^)]*)\).*", r"\1", r) for r in self.retries)
            out.append(f"job {self.job_id}: {self.attempts} attempt(s); failure retries {len(self.retries)}"
                       f"{'/' + str(self.max_retries) if self.max_retries is not None else ''}"
                       f"{' (' + kinds + ')' if kinds else ''}; time-limit requeues {self.requeues}"
                       f"{'/' + str(self.max_requeues) if self.max_requeues is not None else ''}"
                       f"{'; excluded nodes ' + self.excluded if self.excluded else ''}")
        if self.last_failure and self.last_failure != self.hang:  # the hang has lines of its own
            out.append(f"last failure: {self.last_failure}")
        return out


def job_history(run: runs.Run, job_id: str) -> History:
    history = History(job_id)
    for line in run.events():
        parts = line.split(" ", 3)
        if len(parts) < 4 or parts[1] != "job" or parts[2] != job_id:
            continue
        text = parts[3]
        if text.startswith("start on "):
            history.attempts += 1
            m = re.search(r"failure retries \d+/(\d+), time-limit requeues \d+/(\d+)", text)
            if m:
                history.max_retries, history.max_requeues = int(m.group(1)), int(m.group(2))
        elif text.startswith("retry "):
            history.retries.append(text)
            m = re.search(r"\(excluded nodes: ([^)]*)\)$", text)
            if m:
                history.excluded = m.group(1)
        elif text.startswith("time-limit requeue "):
            history.requeues += 1
        elif text.startswith("preflight "):
            history.preflight = text
        if text.startswith(FAILURES):
            history.last_failure = text
        if text.startswith("hang:"):
            history.hang = text
    return history


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


def _job_row(run: runs.Run, sub: dict) -> tuple[str, str, str, str, str]:
    job_id = sub.get("job_id")
    if job_id is None:
        from jobs.local import local_elapsed, local_state

        state, code = local_state(sub)
        return ("local", state, code, local_elapsed(sub), _last_event(run, "local"))
    info = slurm.job_info(job_id) if slurm.available("scontrol") or slurm.available("sacct") else None
    if info is None:
        event = _last_event(run, job_id)
        state = "ENDED" if event.startswith("end exit") else "UNKNOWN"
        return (job_id, state, event.removeprefix("end exit ") if state == "ENDED" else "", "", event)
    return (job_id, info.state, info.exit_code, info.elapsed, info.reason or _last_event(run, job_id))


def image_drift(run: runs.Run) -> str | None:
    """A note when the image the run's latest job used is not the current build for its config."""
    pinned = run.manifest().get("image") or {}
    if pinned.get("source") != "build":
        return None
    try:
        from containers.image import current_image

        current = current_image(run.config(), root=run.paths.project_dir)
    except (ConfigError, OSError):
        return None
    if current and current.get("hash") and current["hash"] != pinned.get("build_hash"):
        return (f"image: this run uses build {str(pinned.get('build_hash'))[:12]}, the current build is "
                f"{current['hash'][:12]} (a resubmission would use the current one)")
    return None


def show_status(project_dir, run_name: str | None, console) -> int:
    from rich.table import Table

    if run_name:
        run = runs.find_run(run_name, project_dir)
        table = Table(title=f"run {run.name}  {_progress(run)}", title_justify="left")
        for col in ("job", "state", "exit", "elapsed", "last event / reason"):
            table.add_column(col)
        subs = run.manifest().get("submissions", [])
        for sub in subs:
            table.add_row(*_job_row(run, sub))
        console.print(table)
        latest = run.latest_train_job()
        if latest:
            _print_history(run, job_history(run, latest), console)
        image = run.manifest().get("image") or {}
        if image.get("image"):
            console.print(f"image {image['image']}" + (f" (build {image['build_hash'][:12]})"
                                                      if image.get("build_hash") else ""), soft_wrap=True)
        drift = image_drift(run)
        if drift:
            console.print(f"[yellow]note:[/] {drift}", soft_wrap=True)
        return 0
    found = runs.list_runs(project_dir)
    if not found:
        console.print(f"no runs in {runs.runs_root(project_dir)}: `slipway submit CONFIG` makes one")
        return 0
    table = Table(title=f"runs in {runs.runs_root(project_dir)}", title_justify="left")
    for col in ("run", "jobs", "latest job", "state", "exit", "progress", "last event / reason"):
        table.add_column(col)
    for run in found:
        subs = run.manifest().get("submissions", [])
        if subs:
            job, state, code, _, event = _job_row(run, subs[-1])
        else:
            job, state, code, event = "", "not submitted", "", ""
        table.add_row(run.name, str(len(subs)), job, state, code, _progress(run), event)
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
    subs = run.manifest().get("submissions", [])
    if not subs:
        raise ConfigError("RUN", f"run {run.name} has no job yet: `slipway submit` it first")
    if job_id is None and subs[-1].get("local"):
        return _show_local_log(run, subs[-1], follow)
    job_id = job_id or next((s["job_id"] for s in reversed(subs) if s.get("job_id")), None)
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


def _show_local_log(run: runs.Run, sub: dict, follow: bool) -> int:
    """A local run's log (`make local` writes logs/local-STAMP.out); -f follows it while it runs."""
    from jobs.local import local_exit, local_state, same_launch

    path = run.dir / sub.get("log", "")
    if not path.is_file():
        raise ConfigError("RUN", f"no log at {path}")
    tail = runs._Tail(path, sys.stdout)
    tail.pump()
    while follow and local_state(sub)[0] == "RUNNING":
        time.sleep(1.0)
        tail.pump()
        sub = next((s for s in run.manifest().get("submissions", []) if same_launch(s, sub)), sub)
    tail.pump()
    # as for a Slurm job: printing the log succeeds; following it ends with the launch's exit code
    return (local_exit(*local_state(sub)) or 0) if follow else 0


def cancel(run: runs.Run, console) -> int:
    active = [j for j in run.job_ids() if (info := slurm.job_info(j)) is not None and info.active]
    if not active:
        console.print(f"run {run.name} has no active job")
        return 0
    slurm.scancel(active)
    with (run.dir / "events.log").open("a") as f:
        for job in active:
            f.write(f"{runs.now()} job {job} cancelled by slipway cancel\n")
    deadline = time.time() + 30
    while time.time() < deadline and any((i := slurm.job_info(j)) is not None and i.active for j in active):
        time.sleep(0.5)
    console.print(f"cancelled {', '.join(active)}")
    return 0
