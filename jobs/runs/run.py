"""A run directory on disk, `runs/RUN/`, and the runs of a project.

`runs/RUN/` holds the resolved `config.yaml` the job reads, `env.toml`, `job.sbatch`,
`manifest.json`, the Slurm logs, `events.log` written by the batch script, and what the trainer
writes (metrics, checkpoints). The manifest has one writer (`update_manifest`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from jobs import slurm
from jobs.config import Config, load_config
from jobs.runs import lifecycle
from jobs.runs import lock as runlock
from jobs.runs import manifest as manifests
from jobs.runs.lifecycle import LaunchState
from jobs.runs.manifest import Launch, Manifest, ManifestError
from common import environ
from common.errors import ConfigError, one_line, shown
from common.events import Event, read_events
from common.fs import NotRegularFile, file_kind, ownership, read_tail
from common.metrics_log import latest_by_step, records_of
from common.rundir import RunDir


@dataclass
class Run:
    paths: RunDir

    @property
    def dir(self) -> Path:
        return self.paths.path

    @property
    def name(self) -> str:
        return self.dir.name

    def manifest(self) -> Manifest:
        """The run's manifest as the file holds it now (ManifestError when it cannot be read)."""
        return manifests.read(self.paths.manifest)

    def launches(self) -> list[Launch]:
        """Its Slurm jobs and local launches, oldest first, as the manifest records them."""
        return list(self.manifest().submissions)

    def launch(self, job_id: str) -> Optional[Launch]:
        return next((x for x in self.launches() if not x.local and x.id == job_id), None)

    def job_ids(self) -> list[str]:
        return [x.id for x in self.launches() if not x.local]

    def config(self) -> Config:
        return load_config(self.paths.config)

    def log_path(self, job_id: str, stream: str = "output") -> Path:
        """Where Slurm writes job `job_id`'s log: fixed by the config before submission."""
        launch = self.launch(job_id)
        if launch is not None and launch.kind == "prepare":
            return self.paths.logs / f"prepare-{job_id}.out"  # one file for both streams
        cfg = self.config()
        pattern = cfg.slurm.output if stream == "output" else cfg.slurm.error
        expanded = pattern.replace("%%", "\0").replace("%j", job_id).replace("%x", cfg.run.name).replace("\0", "%")
        return self.dir / expanded

    def events(self) -> list[Event]:
        """Every event of events.log that parses, in the order written."""
        return read_events(self.dir)

    def events_of(self, launch: Launch, events: Optional[list[Event]] = None) -> list[Event]:
        return lifecycle.events_of(launch, self.events() if events is None else events,
                                   self.launches() if launch.local else ())  # a local one's end: the next's start

    def state(self, launch: Launch) -> LaunchState:
        """What events.log says of `launch`: a local launch's whole state (a Slurm job's also needs
        Slurm's word while it runs: jobs/cli/logs.py JobPoll)."""
        return lifecycle.observed_state(launch, self.events_of(launch))

    def last_metrics(self, kind: str = "train") -> dict | None:
        """The latest record of `kind` (train, eval) of the history that stands, from the last 64 KiB of
        metrics.jsonl (1 MiB for the rarer eval); NotRegularFile or PermissionError where unreadable."""
        records = records_of(read_tail(self.paths.metrics, 65536 if kind == "train" else 1 << 20) or b"")
        return next((r for r in reversed(latest_by_step(records)) if r.get("kind") == kind), None)

    def total_steps(self, launch: Optional[Launch] = None) -> Optional[int]:
        """train.steps of the latest training launch (its manifest entry, else the config), None if neither says."""
        launch = launch or next((x for x in reversed(self.launches()) if x.kind == "train"), None)
        if launch is not None and launch.steps is not None:
            return launch.steps
        try:
            return self.config().train.steps
        except (ConfigError, OSError):
            return None


@contextlib.contextmanager
def many_objects() -> Iterator[None]:
    """The cyclic garbage collector off while a command reads what it keeps until it ends (ten
    thousand runs' records, a sweep's points): it would walk them again and again, freeing nothing.
    What was read is then kept out of its later walks too (`gc.freeze`)."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def runs_root(project_dir: Path) -> Path:
    return environ.runs_dir(project_dir)


@dataclass(frozen=True)
class Unreadable:
    """A run slipway cannot read: a teammate's (`denied`), or damaged (a FIFO for a file, garbled): one `line`."""

    path: Path
    why: str
    denied: bool = False

    @property
    def name(self) -> str:
        return self.path.name

    def line(self) -> str:
        return one_line(f"run {self.name}: {self.why}")

    @classmethod
    def of(cls, run_dir: Path, exc: OSError | ManifestError) -> "Unreadable":
        """What reading one of the run's files raised, told for that run."""
        if isinstance(exc, ManifestError):
            why = exc.why if exc.newer is None else f"written by a newer slipway (manifest format {exc.newer})"
            return cls(run_dir, f"{exc.path.name}: {why}", exc.denied)
        if isinstance(exc, PermissionError):
            return cls(run_dir, _denied(run_dir, exc), True)
        name = Path(exc.filename).name if exc.filename else "a file"
        return cls(run_dir, f"{name} {exc.strerror or exc}" if isinstance(exc, NotRegularFile)
                   else f"{name}: {exc.strerror or exc}")


def _denied(run_dir: Path, exc: OSError) -> str:
    """Why the user may not read a run: whose it is, and what is closed (the directory or a file)."""
    closed = run_dir
    if os.access(run_dir, os.R_OK | os.X_OK) and exc.filename:
        closed = Path(exc.filename)
    owner = ownership(closed)
    what = "" if closed == run_dir else f"{closed.name} "
    return f"{what}not readable by you{f' ({owner})' if owner else ''}: a teammate's run? ask its owner"


def run_name(name: str) -> str:
    """`name` as RUN on the command line: one entry of the runs directory, never a path out of it
    nor one of the entries that are no run (the code store, locks, temporary directories)."""
    if not name or name.startswith(".") or "/" in name or "\0" in name or len(name.encode()) > 255:
        raise ConfigError("RUN", f"{shown(name)} is not a run name: give the name of a directory in the runs "
                                 "directory (slipway status lists them)")
    return name


def run_exists(run_dir: Path, field: str = "run.name") -> bool:
    """Whether a run is at `run_dir` (it has a manifest.json); one line naming `field` when one is
    there that this user may not read (a teammate's) or whose manifest is no regular file."""
    found = _stat_manifest(os.fspath(run_dir))
    if isinstance(found, Unreadable):
        if found.denied:
            raise ConfigError(field, found.line())
        raise ManifestError(RunDir(run_dir).manifest, found.why.removeprefix("manifest.json "))
    return found is not None


def find_run(name: str, project_dir: Path) -> Run:
    """The run called `name`; one line when there is none, or none this user may read."""
    root = runs_root(project_dir)
    run_dir = root / run_name(name)
    if not run_exists(run_dir, "RUN"):
        known = scan_runs(project_dir)[0]
        hint = f"; runs: {', '.join(r.name for r in known[-8:])}" if known else ""
        raise ConfigError("RUN", f"no run {shown(name)} in {root}{hint}")
    return Run(RunDir(run_dir, project_dir))


def _stat_manifest(run_dir: str) -> "int | Unreadable | None":
    """The run's manifest mtime in ns (when it last recorded a launch); None: no run; or Unreadable.
    One stat, no read, no Path made: a listing of ten thousand runs is ordered by it."""
    try:
        st = os.stat(os.path.join(run_dir, _MANIFEST))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:  # denied, a link loop, a name too long
        return Unreadable.of(Path(run_dir), exc)
    if not stat.S_ISREG(st.st_mode):
        return Unreadable(Path(run_dir), f"manifest.json is {file_kind(st.st_mode)}, not a regular file")
    return st.st_mtime_ns


_MANIFEST = RunDir(Path("/")).manifest.name


def scan_runs(project_dir: Path) -> tuple[list[Run], list[Unreadable]]:
    """The project's runs, oldest launch record first, and those unreadable, by name; passed over unread:
    entries without a manifest.json or starting with `.` (code store, locks, temporary directories)."""
    root = runs_root(project_dir)
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return [], []
    found: list[tuple[int, str]] = []
    unreadable: list[Unreadable] = []
    for name in names:
        if name.startswith("."):
            continue
        key = _stat_manifest(os.path.join(root, name))
        if isinstance(key, Unreadable):
            unreadable.append(key)
        elif key is not None:
            found.append((key, name))
    found.sort()
    return [Run(RunDir(root / name, project_dir)) for _, name in found], sorted(unreadable, key=lambda u: u.name)


def pinned_images(project_dirs: list[Path]) -> dict[Path, list[str]]:
    """Every squashfs a run pins (its manifest's `image` and each submission's: a requeue runs the
    file its env.toml / srun flags name), resolved, with the runs that pin it. A manifest that
    cannot be read may pin any image: ManifestError, and nothing is pruned."""
    pins: dict[Path, dict[str, None]] = {}  # the runs of each, in order
    seen: set[Path] = set()
    for project_dir in project_dirs:
        found, unreadable = scan_runs(project_dir)
        if unreadable:  # it may pin any image
            raise ConfigError("image prune", f"{unreadable[0].line()}; it may pin an image, so nothing was pruned: "
                                             "move the run directory aside (or have its owner open it), then "
                                             "prune again")
        for run in found:
            if run.dir.resolve() in seen:
                continue
            seen.add(run.dir.resolve())
            try:
                images = run.manifest().images()
            except ManifestError as exc:
                raise exc.restated("it may pin an image, so nothing was pruned",
                                   "restore it from a backup or move the run directory aside, then prune "
                                   "again") from None
            for pin in images:
                for value in (pin.path, pin.image):
                    if value and value.startswith("/"):
                        pins.setdefault(Path(os.path.realpath(value)), {})[run.name] = None
    return {path: list(names) for path, names in pins.items()}


def active_jobs(run: Run, asked: Optional[dict[str, slurm.JobInfo]] = None) -> list[tuple[str, str]]:
    """(job id, state) of the run's jobs Slurm still runs or queues: one query, none where the
    caller `asked` Slurm (for many runs at once) since the manifest last changed."""
    if asked is not None:
        ids = set(run.job_ids())
        return [(job, info.state) for job, info in asked.items() if job in ids and info.active]
    events = run.events()
    answers = lifecycle.ask_slurm((x, run.events_of(x, events)) for x in run.launches() if not x.local)
    return [(job, info.state) for job, info in answers.items() if info.active]


def update_manifest(run: Run, change: Callable[[Manifest], None]) -> Manifest:
    """The one read-modify-write of a run's manifest.json, under the run's lock (held by a launch, else
    taken here) so that no two writers lose entries; a damaged one is left as it is (ManifestError)."""
    with runlock.hold(run.dir, f"slipway: recording in the manifest of {run.name}"):
        manifest = manifests.read(run.paths.manifest)
        change(manifest)
        manifests.write(run.paths.manifest, manifest)
    return manifest
