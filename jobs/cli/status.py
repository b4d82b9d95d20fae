"""`slipway status` and `cancel`: what became of a run's jobs. Each command asks Slurm once for all
the launches it shows (lifecycle.ask_slurm: one squeue, one sacct), not at all for a launch whose end
events.log settles; a listing of every run reads only the end of each run's events.log and metrics.jsonl."""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Callable, Optional, Sequence

from jobs import runs, slurm
from jobs.runs import lifecycle
from jobs.runs import lock as runlock
from jobs.runs.lifecycle import History
from jobs.runs.run import many_objects
from jobs.runs.listing import Facts, facts as listing_facts
from jobs.runs.image import ImagePin
from jobs.runs.manifest import Launch, Manifest, ManifestError
from common.errors import ConfigError, one_line
from common.events import Event, append_event
from common.rundir import LOCAL_JOB, HangLine


def _progress(f: Facts, throughput: bool = False) -> str:
    m = f.train
    if not m:
        return ""
    loss, step, tps = m.get("loss"), m.get("step"), m.get("tokens_per_s")
    step = f"step {step if isinstance(step, int) else '?'}" + (f"/{f.total}" if f.total else "")
    return (step + (f", loss {loss:.3f}" if isinstance(loss, (int, float)) else "")
            + (f", {tokens(tps)} tok/s" if throughput and isinstance(tps, (int, float)) else ""))


def tokens(n: float) -> str:
    """12.3k, 1.20M: a throughput in a narrow column."""
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def _job_row(launch: Launch, own: Sequence[Event], info: Optional[slurm.JobInfo]) -> tuple[str, str, str, str, str]:
    """(job, state, exit, elapsed, last event or reason) of one launch, as the tables show it."""
    state = lifecycle.observed_state(launch, own, info)
    elapsed = lifecycle.elapsed(launch, state, own, info)
    code = "" if state.exit_code is None else str(state.exit_code)
    return (launch.id, state.state, code, elapsed, state.reason or (own[-1].text if own else ""))


def code_lines(run: runs.Run, manifest: Manifest) -> list[str]:
    """The code the run's latest launch runs, and where it changed between launches."""
    code = manifest.code
    history = [(x.id, x.code) for x in manifest.submissions if x.kind == "train"]
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


def image_drift(run: runs.Run, pinned: Optional[ImagePin]) -> str | None:
    """A note when a resubmission would run another build of the run's image settings than `pinned`."""
    if pinned is None or pinned.source != "build":
        return None
    from jobs.runs.image import build_of_settings

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


def say(console, *parts: str | tuple[str, str]) -> None:
    """One line of what files, jobs, Slurm or the environment said, each part escaped by one_line, never markup."""
    from rich.text import Text

    console.print(Text.assemble(*[(one_line(p), "") if isinstance(p, str) else (one_line(p[0]), p[1]) for p in parts]),
                  soft_wrap=True, highlight=False)


def show_status(project_dir, run_name: str | None, console) -> int:
    from rich.table import Table
    from rich.text import Text

    if not run_name:
        return _show_runs(project_dir, console)
    run = runs.find_run(run_name, project_dir)
    manifest = run.manifest()
    launches = manifest.submissions
    events = run.events()
    owns = [lifecycle.events_of(x, events, launches) for x in launches]
    answers = lifecycle.ask_slurm(zip(launches, owns))
    table = Table("job", "state", "exit", "elapsed", "last event / reason",
                  title=Text(one_line(f"run {run.name}  {_progress(listing_facts(run))}")), title_justify="left")
    for launch, own in zip(launches, owns):
        table.add_row(*[Text(one_line(cell)) for cell in _job_row(launch, own, answers.get(launch.id))])
    console.print(table)
    latest = next((x for x in reversed(launches) if x.kind == "train" and not x.local), None)
    if latest:
        _print_history(run, lifecycle.history(latest.id, events), console)
    if latest and isinstance(latest.cluster.get("name"), str):
        say(console, f"cluster {latest.cluster['name']} (its profile, as submitted, is in manifest.json)")
    image = manifest.image
    if image is not None and image.image:
        say(console, f"image {image.image}" + (f" (build {image.build_hash[:12]})" if image.build_hash else ""))
    for line in code_lines(run, manifest):
        say(console, line)
    if drift := image_drift(run, image):
        say(console, ("note:", "yellow"), f" {drift}")
    return 0


LISTING = ("run", "jobs", "latest", "state", "exit", "progress", "last event")  # short: seven columns in 80


def listing(title: str, rows: list[tuple[str, ...]], width: Optional[int] = None,
            heads: tuple[str, ...] = LISTING) -> str:
    """The one table of run listings (status, sweeps, compare): the last column gets what is left of `width`
    (cut short, or below its row when little is left). Plain text: rich's tables take half a millisecond a
    row, and a project may hold ten thousand runs."""
    rows = [heads, *[row if "".join(row).isprintable() else [one_line(c) for c in row] for row in rows]]
    widths = [max(map(len, column)) for column in list(zip(*rows))[:-1]]
    form = "  ".join(f"{{:<{w}}}" for w in widths) + "  "
    lines = []
    for row in rows:
        head, last = form.format(*row), row[-1]
        room = None if width is None else width - len(head)
        if room is None or len(last) <= room:
            lines.append(head + last)
        elif room >= 16:
            lines.append(head + last[:room - 3] + "...")
        else:  # the last event below its row, indented, as much of it as fits
            lines += [head.rstrip(), "    " + (last if len(last) <= width - 4 else last[:width - 7] + "...")]
    title = one_line(title)
    return "\n".join([title[:width] if width else title, *(line.rstrip() for line in lines)]) + "\n"


def width() -> Optional[int]:
    """The terminal's width ($COLUMNS first); None into a pipe or a file, where nothing is cut."""
    if os.environ.get("COLUMNS", "").isdigit():
        return max(40, int(os.environ["COLUMNS"]))
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None


def _show_runs(project_dir, console) -> int:
    """Every run's latest launch's state; a run that cannot be read is a row saying why (and, when
    damaged rather than a teammate's, an error line), every other run listed all the same."""
    found, unreadable = runs.scan_runs(project_dir)
    if not found and not unreadable:
        console.print(one_line(f"no runs in {runs.runs_root(project_dir)}: slipway local or slipway submit makes one"),
                      markup=False, highlight=False)
        return 0
    unread = [(u.name, "", "", "UNREADABLE" if u.denied else "DAMAGED", "", "", u.why) for u in unreadable]
    damaged = [u.line() for u in unreadable if not u.denied]
    rows, more, _ = listing_rows(found)
    # What cannot be read first, by name: the rows a user must act on.
    rows = sorted(unread + [r for r in rows if r[3] in _PROBLEMS], key=lambda r: r[0]) + [
        r for r in rows if r[3] not in _PROBLEMS]
    console.file.write(listing(f"runs in {runs.runs_root(project_dir)}", rows, width()))
    for message in damaged + more:
        print(f"slipway: error: {one_line(message)}", file=sys.stderr)
    return 2 if damaged or more else 0


_PROBLEMS = ("UNREADABLE", "DAMAGED")


def listing_rows(found: Sequence[runs.Run], throughput: bool = False) -> tuple[list[tuple[str, ...]], list[str],
                                                                               list[Optional[Facts]]]:
    """LISTING's row of each run, in order; the error lines of the DAMAGED ones (an UNREADABLE one is a
    teammate's: no error); each run's facts (None where it cannot be read)."""
    read: list[Facts | runs.Unreadable] = []
    damaged = []
    with many_objects():
        for run in found:
            try:
                read.append(listing_facts(run))
            except (ManifestError, OSError) as exc:  # that run alone: the others are listed
                read.append(runs.Unreadable.of(run.dir, exc))
                if not read[-1].denied:
                    damaged.append((run.name, str(exc) if isinstance(exc, ManifestError) else
                                    f"{read[-1].line()}: move the run directory aside, or put back the file its "
                                    "jobs write"))
    answers = lifecycle.ask_slurm((f.latest, f.events) for f in read if isinstance(f, Facts) and f.latest)
    rows = []
    for run, f in zip(found, read):
        if isinstance(f, runs.Unreadable):
            rows.append((f.name, "", "", "UNREADABLE" if f.denied else "DAMAGED", "", "", f.why))
        elif not f.launches:
            rows.append((run.name, "0", "", "not submitted", "", "", ""))
        else:
            state = f.ended or lifecycle.observed_state(f.latest, f.events, answers.get(f.job))
            rows.append((run.name, str(f.launches), f.job, state.state,
                         "" if state.exit_code is None else str(state.exit_code), _progress(f, throughput),
                         state.reason or f.said))
    return rows, [message for _, message in sorted(damaged)], [f if isinstance(f, Facts) else None for f in read]


def _print_history(run: runs.Run, history: History, console) -> None:
    for line in history.lines():
        say(console, line)
    if history.hang:
        attempt = f"attempt {history.hang_attempt} of job {history.job_id}" if history.hang_attempt else \
            f"job {history.job_id}"
        say(console, ("hung", "red"), f" ({attempt}): {history.hang.removeprefix('hang: ')}")
        late = "late: frozen or starved until the teardown"
        for path in run.paths.hang_dumps(history.hang_tag):  # a line per rank's stack dump
            if (line := HangLine.read(path)) is not None:
                say(console, f"  rank {line.rank} on {line.host}: {'on time' if line.on_time else late} "
                             f"({path.relative_to(run.dir)})")
    if history.preflight:
        say(console, f"preflight: {history.preflight.removeprefix('preflight ')}")


# How long `slipway cancel` lets a job's batch script record its end and remove its containers
# (while the allocation still exists) before scancel ends it regardless.
CANCEL_GRACE_SECONDS = 90.0
CANCEL_TOLD_AFTER = 5.0


def cancel(run: runs.Run, console) -> int:
    """Under the run's lock: a submission in progress finishes first (and its job is cancelled too); a
    local launch that trains refuses, naming its launcher."""
    with runlock.hold(run.dir, f"slipway cancel {run.name}"):
        try:
            launches = run.launches()
        except ManifestError as exc:
            raise exc.restated("slipway cannot tell which jobs of the run to cancel",
                               f"`squeue --name {run.name},{run.name}-prepare` lists the jobs of the run's name: "
                               "`scancel` them by id, then restore the file or move the run directory aside") \
                from None
        cancelled = cancel_jobs([(run, launches)])
    console.print(f"cancelled {', '.join(cancelled)}" if cancelled else f"run {run.name} has no active job")
    return 0


def cancel_jobs(found: Sequence[tuple[runs.Run, Sequence[Launch]]]) -> list[str]:
    """Cancel every active Slurm job of the runs `found`; the ids cancelled. Pending jobs first (no batch
    shell to signal, and a sweep's would start as its running ones end); then USR2 to the running ones'
    batch shells (jobs/slurm/job_lib.sh on_cancel: end exit 140), one grace for all, and scancel the rest."""
    owner: dict[str, runs.Run] = {}
    asked = []
    for run, launches in found:
        events = run.events()
        for x in launches:
            if not x.local:
                owner[x.id] = run
                asked.append((x, run.events_of(x, events)))
    answers = lifecycle.ask_slurm(asked)
    active = [j for j, info in answers.items() if info.active]
    if not active:
        return []

    def still_active() -> list[str]:
        return [j for j, info in slurm.jobs_info(active).items() if info.active]

    def left_after(seconds: float, slow: str = "") -> list[str]:
        start = time.time()
        while (left := still_active()) and time.time() < start + seconds:
            if slow and time.time() > start + CANCEL_TOLD_AFTER:  # a batch shell slow to end: said once
                print(slow.format(", ".join(left)), file=sys.stderr)
                slow = ""
            time.sleep(0.5)
        return left

    running = [j for j in active if answers[j].state.split()[:1] == ["RUNNING"]]
    pending = [j for j in active if j not in running]
    if pending:
        _scancel(pending, still_active)
        for job in pending:  # no batch shell to say so itself
            append_event(owner[job].dir, job, "cancelled by slipway cancel")
    if running:
        _scancel(running, still_active, "USR2")
    grace = CANCEL_GRACE_SECONDS if running else 0
    if left := left_after(grace, f"waiting for job(s) {{}} to save and record their end (scancel at {grace:.0f} s)"):
        if grace:
            print(f"job(s) {', '.join(left)} did not end in {grace:.0f} s: scancel", file=sys.stderr)
        _scancel(left, still_active)
        left_after(30)
    return active


def _scancel(jobs: list[str], still_active: Callable[[], list[str]], signal: Optional[str] = None) -> None:
    """scancel (`signal`: to the batch shells); a job that ended meanwhile fails it, and is no failure."""
    try:
        slurm.scancel(jobs, signal, batch=signal is not None)
    except slurm.SlurmError:
        if set(jobs) & set(still_active()):
            raise
