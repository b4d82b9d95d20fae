"""The run directory, the unit of reproducibility, and everything that submits into it.

`runs/RUN/` holds the resolved `config.yaml` the job reads, `env.toml`,
`job.sbatch`, `manifest.json` (git state, image, submit times, job ids), the
Slurm logs, `events.log` written by the batch script, and what the trainer
writes (metrics, checkpoints). Files are written atomically; a new run
directory appears only once complete; a run is never silently overwritten.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

from plumbum import local

from edf import Environment, expand_host, render_edf, srun_flags
from jobs import slurm
from jobs.config import Config, config_changes, dump_config, load_config
from jobs.runs import lifecycle
from jobs.runs import lock as runlock
from jobs.runs import manifest as manifests
from jobs.runs.code import STORE as CODE_STORE, Snapshot, git_diff, git_state, plan_snapshot, prune_store
from jobs.runs.container import (ImagePin, create_needed_dirs, kept_build, pin_image, remove_created_dirs,
                                 resolve_paths, run_environment)
from jobs.runs.lifecycle import LaunchState
from jobs.runs.manifest import MANIFEST, Launch, Manifest, ManifestError
from jobs.slurm.script import (LIB_DIR, PREPARE_SCRIPT, RunPaths, check_env_from_host, library_files, render_prepare_sbatch,
                               render_sbatch)
from kernel import environ
from kernel.errors import ConfigError
from kernel.fs import write_atomic
from kernel.rundir import METRICS_FILE, CodeSnapshot, Event, append_event, complete_checkpoints, read_events, tail_events


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class Run:
    """A run directory on disk."""

    paths: RunPaths
    _read: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)  # (file key, manifest or error)

    @property
    def dir(self) -> Path:
        return self.paths.run_dir

    @property
    def name(self) -> str:
        return self.dir.name

    def manifest(self) -> Manifest:
        """The run's manifest as the file holds it now (read again only once the file changed);
        ManifestError, naming the file and what to do, when it cannot be read."""
        path = self.dir / MANIFEST
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
            return self.dir / "logs" / f"prepare-{job_id}.out"  # one file for both streams
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

    def last_metrics(self) -> dict | None:
        """The latest training record of the history that stands (a restart undoes the steps
        after its checkpoint), read from the end of metrics.jsonl: its last KiB, else 64 KiB."""
        from trainer.history import latest_by_step

        path = self.dir / METRICS_FILE
        for window in (1024, 65536):
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
            train = [r for r in latest_by_step(records) if r.get("kind") == "train"]
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
    if not (run_dir / MANIFEST).is_file():
        known = list_runs(project_dir)
        hint = f"; runs: {', '.join(r.name for r in known[-8:])}" if known else ""
        raise ConfigError("RUN", f"no run {name!r} in {runs_root(project_dir)}{hint}")
    return Run(RunPaths(run_dir, project_dir))


def list_runs(project_dir: Path) -> list[Run]:
    root = runs_root(project_dir)
    if not root.is_dir():
        return []
    found = [Run(RunPaths(p, project_dir)) for p in root.iterdir() if (p / MANIFEST).is_file()]
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


@dataclass
class Sealed:
    """A submission resolved once: the frozen config (absolute paths), the pinned image,
    the run's container environment, and the text of every file it writes."""

    cfg: Config
    paths: RunPaths
    pin: ImagePin
    env: Environment
    files: dict[str, str]
    notes: list[str]  # what the user should know before the job runs (said at submit and dry run)
    code: Optional[Snapshot] = None  # the code snapshot the ranks run (None: code.snapshot false)

    @property
    def job_lib(self) -> dict[str, str]:
        """The job libraries job.sbatch sources, by their place in the run directory, and their sha256."""
        return {name: hashlib.sha256(text.encode()).hexdigest() for name, text in self.files.items()
                if name.startswith(f"{LIB_DIR}/")}

    @property
    def snapshot(self) -> Optional[CodeSnapshot]:
        return self.code.value if self.code else None

    def data_status(self):
        """Where the run's data stands in its token cache (trainer.prepare.CacheStatus)."""
        from trainer.prepare import cache_status

        return cache_status(self.cfg.data, self.cfg.data.cache_dir)

    def with_prepare_script(self) -> "Sealed":
        """The run's files plus the data preparation job's batch script."""
        files = {**self.files, PREPARE_SCRIPT: render_prepare_sbatch(self.cfg, self.paths, self.env)}
        _check_script_syntax(self.cfg, files[PREPARE_SCRIPT])
        return replace(self, files=files)


def check_submittable(cfg: Config) -> None:
    """What must hold on disk at submission, beyond the image and the paths `seal` checks."""
    c = cfg.container
    check_env_from_host(cfg)
    if c.in_container:
        for i, mount in enumerate(c.mounts):
            src = expand_host(mount.src, f"container.mounts[{i}]")
            if not Path(src).exists():
                raise ConfigError(f"container.mounts[{i}]", f"mount source {src} does not exist on this node")
    if cfg.train.script and not Path(cfg.train.script).is_file():
        raise ConfigError("train.script", f"training script {cfg.train.script} does not exist")


def _check_script_syntax(cfg: Config, script: str) -> None:
    """`bash -n` on the batch script: a syntax error fails here, not after queueing."""
    if shutil.which("bash") is None:
        return
    rc, _, err = (local["bash"]["-n"] << script).run(retcode=None)
    if rc != 0:
        error = " ".join(err.replace("bash: ", "").split())
        field = "launch.pre_launch" if cfg.launch.pre_launch else "job.sbatch"
        raise ConfigError(field, f"the batch script does not parse ({error}): fix the shell syntax of "
                                 f"launch.pre_launch")


def seal(cfg: Config, project_dir: Path, *, dry_run: bool = False) -> Sealed:
    """Resolve a submission of `cfg` (nothing written). A dry run reports a missing image as a
    note and renders with the path `make image` would write, instead of failing."""
    paths = RunPaths(runs_root(project_dir) / cfg.run.name, project_dir.absolute())
    cfg = resolve_paths(cfg, paths)
    notes: list[str] = []
    try:
        pin = pin_image(cfg, paths.project_dir, notes)
    except ConfigError as exc:
        if not dry_run:
            raise
        notes.append(f"a real submission would fail: {exc}")
        from containers.context import resolve_path

        link = resolve_path(paths.project_dir, cfg.image.output_dir) / f"{cfg.image.name}.sqsh"
        pin = ImagePin(cfg.container.image, cfg.container.image or str(link), "none")
    code = (plan_snapshot(paths.run_dir.parent / CODE_STORE, cfg.train.script, paths.project_dir)
            if cfg.code.snapshot else None)
    if code is not None and code.untracked:
        shown = ", ".join(code.untracked[:5]) + (f" and {len(code.untracked) - 5} more" if len(code.untracked) > 5 else "")
        notes.append(f"not in the code snapshot, as git does not track them: {shown} (`git add` what the run needs)")
    env = run_environment(cfg, paths, pin, code.value if code else None)
    script = render_sbatch(cfg, paths, env, pin.pins(code.value if code else None, kept_build(cfg, pin)))
    _check_script_syntax(cfg, script)
    files = {"config.yaml": dump_config(cfg), "job.sbatch": script, **library_files(env)}
    if env.in_container:
        files["env.toml"] = render_edf(env)
        if env.runtime == "pyxis":
            notes += [f"pyxis: {w}" for w in srun_flags(env, paths.env_toml).warnings]
    return Sealed(cfg, paths, pin, env, files, notes, code)


def active_jobs(run: Run) -> list[tuple[str, str]]:
    """(job id, state) of this run's jobs that Slurm still runs or queues (one query for all)."""
    events = run.events()
    answers = lifecycle.ask_slurm((x, run.events_of(x, events)) for x in run.launches() if not x.local)
    return [(job, info.state) for job, info in answers.items() if info.active]


def no_world_write() -> int:
    """Mask o+w in this process's umask, for good: whatever it and its children create (run
    directories, logs/, history/, a local run's checkpoints; a job sbatch submits from here,
    as Slurm applies the submitter's umask to it) is never writable by every user, even under
    umask 000. Returns the umask now in force."""
    umask = os.umask(0) | 0o002
    os.umask(umask)
    return umask


def _group_readable(path: Path) -> None:
    """mkdtemp makes 0700 directories: give the run directory the user's umask (teammates
    on a shared project folder read runs), never writable by others."""
    os.chmod(path, 0o777 & ~no_world_write())


def config_difference(path: Path, new: str) -> Optional[str]:
    """How the run's config.yaml differs from `new` (the resolved config a launch would write),
    None if it does not. The old file is read through today's schema and dumped again: a key a
    later slipway added, at its default, is no difference."""
    try:
        old = path.read_text()
    except FileNotFoundError:
        return "no config.yaml"
    if old == new:
        return None
    try:
        resolved = dump_config(load_config(path))
    except ConfigError as exc:
        return f"a config this slipway no longer reads ({exc})"
    return None if resolved == new else f"a different config ({config_changes(resolved, new)})"


def _mode(name: str) -> int:
    """job.sbatch runs; a pinned library (lib/, by hash) is never edited; the rest is data."""
    return 0o755 if name == "job.sbatch" else 0o444 if name.startswith(f"{LIB_DIR}/") else 0o644


def prepare_run(sealed: Sealed, *, force: bool = False) -> tuple[Run, bool]:
    """Create or reuse `runs/RUN/`; returns (run, created).

    Same run name and same resolved config: the run resumes (generated files refreshed,
    earlier versions kept in history/). A different config is refused unless `force`,
    and then the old config is kept in `history/` too. A run with a job still queued or
    running is never rewritten: that job reads these files."""
    cfg, paths, files = sealed.cfg, sealed.paths, sealed.files
    run = Run(paths)
    no_world_write()
    if (paths.run_dir / MANIFEST).is_file():
        mode = paths.run_dir.stat().st_mode
        if mode & 0o002:  # made under umask 000 before slipway masked it
            os.chmod(paths.run_dir, mode & 0o7775)
        active = active_jobs(run)
        if active:
            jobs = ", ".join(f"{j} ({state})" for j, state in active)
            raise ConfigError("run.name", f"run {cfg.run.name} has a job queued or running ({jobs}), which reads "
                                          f"its files: wait for it to end or `slipway cancel {cfg.run.name}` first")
        differs = config_difference(paths.config, files["config.yaml"])
        if differs and not force:
            raise ConfigError("run.name", f"run {cfg.run.name} exists with {differs} in {paths.config}: pick "
                                          "another --run-name, or pass --force to replace its config (the old "
                                          "one is kept in history/)")
        if sealed.code is not None:
            sealed.code.write()  # before job.sbatch names it; content-addressed, so never rewritten
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
        for name, text in files.items():
            target = paths.run_dir / name
            if target.exists() and target.read_text() != text:
                stem, dot, ext = name.partition(".")
                write_atomic(paths.run_dir / "history" / f"{stem}-{stamp}{dot}{ext}", target.read_text())
            write_atomic(target, text, _mode(name))
        return run, False
    root = paths.run_dir.parent
    root.mkdir(parents=True, exist_ok=True)
    if sealed.code is not None:
        sealed.code.write()
    tmp = Path(tempfile.mkdtemp(prefix=f".{cfg.run.name}.", suffix=".tmp", dir=root))
    try:
        _group_readable(tmp)
        for name, text in files.items():
            write_atomic(tmp / name, text, _mode(name))
        (tmp / "logs").mkdir()
        manifests.write(tmp / MANIFEST, Manifest(
            run=cfg.run.name, created=now(), project_dir=str(paths.project_dir), git=git_state(paths.project_dir),
            image=sealed.pin, runtime=cfg.container.runtime, launcher=cfg.launch.launcher,
            config_sha256=hashlib.sha256(files["config.yaml"].encode()).hexdigest()))
        try:
            # rename(2) onto a missing name: two submissions racing for one name cannot both win.
            os.rename(tmp, paths.run_dir)
        except OSError:
            raise ConfigError("run.name", f"run {cfg.run.name} was created by another submission just now: "
                                          "submit again to resume it, or pick another --run-name") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return run, True


def update_manifest(run: Run, change: Callable[[Manifest], None]) -> Manifest:
    """The one read-modify-write of a run's manifest.json: under the run's lock (held already by
    a launch; else taken here), so that no two writers lose each other's entries. A damaged one
    is left as it is (ManifestError): what it held is not written over."""
    with runlock.hold(run.dir, f"slipway: recording in the manifest of {run.name}"):
        manifest = manifests.read(run.dir / MANIFEST)
        change(manifest)
        manifests.write(run.dir / MANIFEST, manifest)
    return manifest


def record_submission(run: Run, job_id: str, sealed: Sealed, kind: str = "train", after: str = "") -> None:
    script = run.dir / (PREPARE_SCRIPT if kind == "prepare" else "job.sbatch")
    entry = Launch(job_id=job_id, kind=kind, submitted=now(), after=after, git=git_state(run.paths.project_dir),
                   image=sealed.pin, code=sealed.snapshot, steps=sealed.cfg.train.steps if kind == "train" else None,
                   script_sha256=hashlib.sha256(script.read_bytes()).hexdigest(),
                   job_lib=sealed.job_lib if kind == "train" else {})

    def add(manifest: Manifest) -> None:
        manifest.image = sealed.pin  # what the latest job runs
        if kind == "train":
            record_code(run, manifest, sealed, job_id)
            manifest.job_lib = sealed.job_lib
        manifest.submissions.append(entry)

    update_manifest(run, add)
    if kind == "train":
        prune_code_store(run.dir.parent)


def record_code(run: Run, manifest: Manifest, sealed: Sealed, launch: str) -> None:
    """Inside a manifest update: the code this training launch runs becomes the run's, its
    uncommitted changes go to code/HASH12.diff, and a change from the last launch's code is an
    event and a file in history/ beside the configs and scripts it replaced (status says it)."""
    before, after = manifest.code, sealed.snapshot
    manifest.code = after
    if after is not None and after.dirty and not (run.dir / "code" / f"{after.hash12}.diff").exists():
        write_atomic(run.dir / "code" / f"{after.hash12}.diff", git_diff(after))
    if (before.hash if before else None) == (after.hash if after else None) or not manifest.submissions:
        return
    was, becomes = (c.hash12 if c else "the image's" for c in (before, after))
    append_event(run.dir, launch, f"code changed {was} -> {becomes}")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    write_atomic(run.dir / "history" / f"code-{stamp}.json",
                 json.dumps({"before": before.record() if before else None,
                             "after": after.record() if after else None}, indent=2) + "\n")


PRUNE_EVERY_SECONDS = 3600  # the store keeps what no run names for a day: an hourly pass loses nothing


def prune_code_store(root: Path, *, now: Optional[float] = None) -> list[tuple[str, int]]:
    """The code store of runs root `root` without the snapshots no run names (jobs/runs/code.py
    `prune_store`), after a launch recorded its own: at most once in PRUNE_EVERY_SECONDS (it reads
    every run's manifest; RUNS/.code.pruned says when it last did). Nothing is removed when a
    manifest cannot be read: what it names is then unknown."""
    stamp = root / f"{CODE_STORE}.pruned"
    now = time.time() if now is None else now
    try:
        if now - stamp.stat().st_mtime < PRUNE_EVERY_SECONDS:
            return []
    except FileNotFoundError:
        pass
    named: set[str] = set()
    try:
        for path in root.iterdir():
            if (path / MANIFEST).is_file():
                named |= {Path(c.dir).name for c in manifests.read(path / MANIFEST).snapshots()}
        removed = prune_store(root / CODE_STORE, named)
        stamp.touch()
        os.utime(stamp, (now, now))
        return removed
    except (OSError, ManifestError):
        return []


def unprepared_data(sealed: Sealed, config_args: str) -> Optional[str]:
    """Why the run cannot start on its token cache as it is (None: it can); `config_args` is what
    the suggested `slipway prepare` repeats (`Config.config_args`: the user's own arguments)."""
    status = sealed.data_status()
    if status.prepared or status.tokenize_in_job:
        return None
    missing = "; ".join(e.describe() for e in status.missing)
    # The fix first: a message too long for one line keeps its start and its end.
    return (f"the token cache is not prepared: run `slipway prepare {config_args}` first (here, or with "
            "--as-job on a CPU node), or submit with --prepare to queue the preparation before the training job; "
            f"data.tokenize_in_job: true lets rank 0 tokenize in the job while every GPU waits; {missing}")


def nothing_to_train(cfg: Config, run_dir: Path, command: str) -> Optional[str]:
    """Why a launch of the run would train nothing (None: it has steps left): its latest
    checkpoint already reached train.steps. `command` (`local`, `submit`) is the command the
    suggestion to train on repeats; `slipway local` and `submit` say the same before starting."""
    steps = complete_checkpoints(run_dir / cfg.checkpoint.dir)
    if not steps or steps[-1] < cfg.train.steps:
        return None
    more = cfg.config_args_setting({"train.steps": steps[-1] + cfg.train.steps})
    return (f"run {cfg.run.name} already reached train.steps={cfg.train.steps} (checkpoint at step {steps[-1]}): "
            f"nothing to train; to train on, `{environ.invocation()} {command} {more} --force` (a changed config: the "
            "old one is kept in history/), or pick another --run-name for a new run")


def submit(cfg: Config, project_dir: Path, *, force: bool = False, prepare: bool = False,
           before_writing: Optional[Callable[[], None]] = None) -> tuple[Run, str, Sealed, Optional[str]]:
    """Seal the submission, write the run directory and `sbatch` it; returns (run, job id,
    sealed, the id of the data preparation job it waits for or None).

    A run whose token cache is not prepared is refused, unless `prepare`: then a CPU job
    prepares it and the training job starts after that one completed."""
    check_submittable(cfg)
    sealed = seal(cfg, project_dir)
    done = nothing_to_train(cfg, sealed.paths.run_dir, "submit")
    if done:
        raise ConfigError("train.steps", done)
    why = unprepared_data(sealed, cfg.config_args)
    if why and not prepare:
        raise ConfigError("data", why)
    if why:
        sealed = sealed.with_prepare_script()
    if before_writing is not None:  # the caller's last check (a controller to submit to), input checked
        before_writing()
    no_world_write()
    # One launch of a run at a time: from the check for its active jobs to the record of this one.
    with runlock.hold(sealed.paths.run_dir, f"slipway submit {cfg.config_args}"):
        return _submit_locked(sealed, force=force, why=why)


def _submit_locked(sealed: Sealed, *, force: bool, why: Optional[str]) -> tuple[Run, str, Sealed, Optional[str]]:
    made = create_needed_dirs(sealed.cfg, sealed.paths)
    try:
        run, created = prepare_run(sealed, force=force)
    except BaseException:
        remove_created_dirs(made)
        raise
    prep_id = None
    try:
        if why:
            prep_id = slurm.sbatch(run.dir / PREPARE_SCRIPT, cwd=run.paths.project_dir)
            record_submission(run, prep_id, sealed, kind="prepare")
        job_id = slurm.sbatch(run.paths.script, cwd=run.paths.project_dir, after=prep_id)
    except slurm.SlurmError:
        if prep_id:  # the training job was refused: the preparation alone is no use to anyone
            with contextlib.suppress(slurm.SlurmError):
                slurm.scancel([prep_id])
        remove_created_dirs(made)
        if created and not prep_id:  # nothing ran: leave no trace of a run that never was
            if sealed.code is not None:
                sealed.code.discard()
            shutil.rmtree(run.dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                run.dir.parent.rmdir()  # only if that left it empty
        raise
    record_submission(run, job_id, sealed, after=prep_id or "")
    return run, job_id, sealed, prep_id


def submit_prepare(cfg: Config, project_dir: Path, *, force: bool = False) -> tuple[Run, str, Sealed]:
    """`slipway prepare --as-job`: the run's data preparation as a CPU job of its own."""
    check_submittable(cfg)
    sealed = seal(cfg, project_dir).with_prepare_script()
    with runlock.hold(sealed.paths.run_dir, f"slipway prepare {cfg.config_args} --as-job"):
        return _submit_prepare_locked(sealed, force=force)


def _submit_prepare_locked(sealed: Sealed, *, force: bool) -> tuple[Run, str, Sealed]:
    made = create_needed_dirs(sealed.cfg, sealed.paths)
    try:
        run, created = prepare_run(sealed, force=force)
    except BaseException:  # refused (a running job, a different config): leave no directory behind
        remove_created_dirs(made)
        raise
    try:
        job_id = slurm.sbatch(run.dir / PREPARE_SCRIPT, cwd=run.paths.project_dir)
    except BaseException:
        remove_created_dirs(made)
        if created:  # nothing ran: leave no trace of a run that never was
            shutil.rmtree(run.dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                run.dir.parent.rmdir()  # only if that left it empty
        raise
    record_submission(run, job_id, sealed, kind="prepare")
    return run, job_id, sealed
