"""A run directory on disk, `runs/RUN/`, and the runs of a project.

`runs/RUN/` holds the resolved `config.yaml` the job reads, `env.toml`,
`job.sbatch`, `manifest.json` (git state, image, submit times, job ids), the
Slurm logs, `events.log` written by the batch script, and what the trainer
writes (metrics, checkpoints). The manifest has one writer (`update_manifest`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from jobs import slurm
from jobs.config import Config, load_config
from jobs.runs import lifecycle
from jobs.runs import lock as runlock
from jobs.runs import manifest as manifests
from jobs.runs.container import ImagePin
from jobs.runs.lifecycle import LaunchState
from jobs.runs.manifest import Launch, Manifest, ManifestError
from common.rundir import RunDir
from common.errors import ConfigError
from common.events import Event, read_events, tail_events
from common.rundir import CodeSnapshot


@dataclass
class Run:
    """A run directory on disk."""

    paths: RunDir
    _read: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)  # (file key, manifest or error)

    @property
    def dir(self) -> Path:
        return self.paths.path

    @property
    def name(self) -> str:
        return self.dir.name

    def manifest(self) -> Manifest:
        """The run's manifest as the file holds it now (read again only once the file changed);
        ManifestError, naming the file and what to do, when it cannot be read."""
        path = self.paths.manifest
        key = manifests.file_key(path)
        if key is None or self._read is None or self._read[0] != key:
            try:
                self._read = (key, manifests.read(path))
            except ManifestError as exc:
                self._read = (key, exc)
        found = self._read[1]
        if isinstance(found, ManifestError):
            raise found
        return found

    def image(self) -> Optional[ImagePin]:
        """The image the run's latest job runs, as pinned at its submission (None: never submitted)."""
        return self.manifest().image

    def images(self) -> list[ImagePin]:
        """Every image a job of the run was submitted with (a requeue runs its own job's)."""
        return self.manifest().images()

    def code(self) -> Optional[CodeSnapshot]:
        """The code snapshot the run's latest launch runs (None: the image's own code)."""
        return self.manifest().code

    def code_history(self) -> list[tuple[str, Optional[CodeSnapshot]]]:
        """(launch, its code snapshot) for each training launch, oldest first ("local" for one here)."""
        return [(x.id, x.code) for x in self.launches() if x.kind == "train"]

    def launches(self) -> list[Launch]:
        """Its Slurm jobs and local launches, oldest first, as the manifest records them."""
        return list(self.manifest().submissions)

    def launch(self, job_id: str) -> Optional[Launch]:
        """Slurm job `job_id` of this run, or None."""
        return next((x for x in self.launches() if not x.local and x.id == job_id), None)

    def job_ids(self) -> list[str]:
        return [x.id for x in self.launches() if not x.local]

    def latest_train_job(self) -> str | None:
        """The id of the run's latest Slurm training job (its preparation jobs aside)."""
        return next((x.id for x in reversed(self.launches()) if not x.local and x.kind == "train"), None)

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
        return lifecycle.events_of(launch, self.events() if events is None else events, self.launches())

    def recent_events(self, launch: Launch) -> list[Event]:
        """The events of events.log from `launch`'s last start on, read from the file's end: a
        listing reads no more of a long history than the state of the latest launch needs."""
        return lifecycle.events_of(launch, tail_events(self.dir, lambda e: e.job == launch.id and
                                                       e.kind in lifecycle.STARTS), [launch])

    def state(self, launch: Launch, info: Optional[slurm.JobInfo] = None, *, ask_slurm: bool = True) -> LaunchState:
        """What became of `launch`: events.log read, the local processes looked at, Slurm asked
        where events.log does not settle it (unless `info` is given or `ask_slurm` is off);
        `lifecycle.launch_state` decides."""
        own = self.events_of(launch)
        if launch.local:
            return lifecycle.launch_state(launch, own, process=lifecycle.observe_local(launch))
        if info is None and ask_slurm:
            info = lifecycle.ask_slurm([(launch, own)]).get(launch.id)
        return lifecycle.launch_state(launch, own, info)

    def last_metrics(self, kind: str = "train") -> dict | None:
        """The latest training record (or of another `kind`: eval) of the history that stands (a
        restart undoes the steps after its checkpoint), read from the end of metrics.jsonl: its last
        KiB, else 64 KiB (1 MiB for an eval record, written more rarely)."""
        from common.metrics_log import latest_by_step

        path = self.paths.metrics
        for window in (1024, 65536, *((1 << 20,) if kind != "train" else ())):
            try:
                with path.open("rb") as f:
                    size = f.seek(0, os.SEEK_END)
                    f.seek(max(0, size - window))
                    lines = f.read().decode(errors="replace").splitlines()
            except FileNotFoundError:
                return None
            records = []
            for line in lines:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # the window's first, cut line, or one a crash cut
                if isinstance(record, dict):
                    records.append(record)
            train = [r for r in latest_by_step(records) if r.get("kind") == kind]
            if train or size <= window:
                return train[-1] if train else None
        return None

    def total_steps(self, launch: Optional[Launch] = None) -> Optional[int]:
        """train.steps of the latest training launch (its manifest entry says; the config for one
        recorded before entries did), None when neither says."""
        launch = launch or next((x for x in reversed(self.launches()) if x.kind == "train"), None)
        if launch is not None and launch.steps is not None:
            return launch.steps
        try:
            return self.config().train.steps
        except (ConfigError, OSError):
            return None


def runs_root(project_dir: Path) -> Path:
    return Path(os.environ.get("SLIPWAY_RUNS", project_dir / "runs")).absolute()


def find_run(name: str, project_dir: Path) -> Run:
    run_dir = runs_root(project_dir) / name
    if not RunDir(run_dir).manifest.is_file():
        known = list_runs(project_dir)
        hint = f"; runs: {', '.join(r.name for r in known[-8:])}" if known else ""
        raise ConfigError("RUN", f"no run {name!r} in {runs_root(project_dir)}{hint}")
    return Run(RunDir(run_dir, project_dir))


def list_runs(project_dir: Path) -> list[Run]:
    root = runs_root(project_dir)
    if not root.is_dir():
        return []
    found = [Run(RunDir(p, project_dir)) for p in root.iterdir() if RunDir(p).manifest.is_file()]
    return sorted(found, key=lambda r: (_created(r), r.name))


def _created(run: Run) -> str:
    try:
        return run.manifest().created
    except ManifestError:
        return ""  # listed first, where its damage is seen


def pinned_images(project_dirs: list[Path]) -> dict[Path, list[str]]:
    """Every squashfs a run pins (its manifest's `image` and each submission's: a requeue
    runs the file its env.toml / srun flags name), resolved, with the runs that pin it.
    The runs root is $SLIPWAY_RUNS, else each project directory's runs/. A manifest that cannot
    be read may pin any image: ManifestError, and nothing is pruned."""
    pins: dict[Path, list[str]] = {}
    seen: set[Path] = set()
    for project_dir in project_dirs:
        for run in list_runs(project_dir):
            if run.dir.resolve() in seen:
                continue
            seen.add(run.dir.resolve())
            try:
                images = run.images()
            except ManifestError as exc:
                raise exc.restated("it may pin an image, so nothing was pruned",
                                   "restore it from a backup or move the run directory aside, then prune "
                                   "again") from None
            for pin in images:
                for value in (pin.path, pin.image):
                    if value and value.startswith("/"):
                        names = pins.setdefault(Path(os.path.realpath(value)), [])
                        if run.name not in names:
                            names.append(run.name)
    return pins


def active_jobs(run: Run, asked: Optional[dict[str, slurm.JobInfo]] = None) -> list[tuple[str, str]]:
    """(job id, state) of this run's jobs that Slurm still runs or queues (one query for all;
    none where the caller `asked` Slurm for them, with other runs', since the manifest last changed)."""
    if asked is not None:
        ids = set(run.job_ids())
        return [(job, info.state) for job, info in asked.items() if job in ids and info.active]
    events = run.events()
    answers = lifecycle.ask_slurm((x, run.events_of(x, events)) for x in run.launches() if not x.local)
    return [(job, info.state) for job, info in answers.items() if info.active]


def update_manifest(run: Run, change: Callable[[Manifest], None]) -> Manifest:
    """The one read-modify-write of a run's manifest.json: under the run's lock (held already by
    a launch; else taken here), so that no two writers lose each other's entries. A damaged one
    is left as it is (ManifestError): what it held is not written over."""
    with runlock.hold(run.dir, f"slipway: recording in the manifest of {run.name}"):
        manifest = manifests.read(run.paths.manifest)
        change(manifest)
        manifests.write(run.paths.manifest, manifest)
    return manifest
