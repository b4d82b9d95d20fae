"""Submitting into a run directory: a submission sealed once (`seal`), the directory written
whole or not at all (`prepare_run`), then `sbatch` and the manifest's record of the job.

A new run directory appears only once complete (a rename); an existing one is never rewritten
under a queued or running job, and what a launch replaces is kept in `history/`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

from plumbum import local

from containers.context import resolve_path
from edf import Environment, render_edf, srun_flags
from jobs import slurm
from jobs.config import Config, dump_config
from jobs.runs import lock as runlock
from jobs.runs import manifest as manifests
from jobs.runs.checks import check_submittable, config_difference
from jobs.runs.code import STORE as CODE_STORE, Snapshot, git_diff, git_state, plan_snapshot, prune_code_store
from jobs.runs.image import ImagePin, container_project, kept_build, pin_image
from jobs.runs.container import create_needed_dirs, hf_home, remove_created_dirs, resolve_paths, run_environment
from jobs.runs.manifest import Launch, Manifest
from jobs.runs.run import Run, active_jobs, run_exists, runs_root, update_manifest
from jobs.slurm.bad_nodes import plan_exclusions
from jobs.slurm import warm as warm_ranks
from jobs.slurm.script import library_files, render_prepare_sbatch, render_sbatch
from common import environ
from common.errors import ConfigError
from common.schema import to_dict
from common.fs import write_atomic
from common.yaml import read_text_bounded
from common.events import append_event, now_iso
from common.rundir import CodeSnapshot, RunDir, complete_checkpoints


@dataclass
class Sealed:
    """A submission resolved once: the frozen config, pinned image, container environment, files."""

    cfg: Config
    paths: RunDir
    pin: ImagePin
    env: Environment
    files: dict[Path, str]  # each file's text, by its path in the run directory
    notes: list[str]  # what the user should know before the job runs (said at submit and dry run)
    code: Optional[Snapshot] = None  # the code snapshot the ranks run (None: code.snapshot false)
    # What a forced launch replaced (`prepare_run`): "a different config (train.steps 200 -> 400); the
    # old one is in runs/RUN/history/config-STAMP.yaml"; "" when it replaced no config.
    replaced: str = ""
    exclude: list[str] = field(default_factory=list)  # the bad nodes its cluster remembers, which it excludes

    @property
    def job_lib(self) -> dict[str, str]:
        """The job libraries job.sbatch sources, by their place in the run directory, and their sha256."""
        return {path.relative_to(self.paths.path).as_posix(): hashlib.sha256(text.encode()).hexdigest()
                for path, text in self.files.items() if path.parent == self.paths.lib}

    @property
    def snapshot(self) -> Optional[CodeSnapshot]:
        return self.code.value if self.code else None

    def data_status(self):
        """Where the run's data stands in its token cache (trainer.prepare.CacheStatus)."""
        from jobs import trainer_door

        return trainer_door.data_status(self.cfg.data, self.cfg.data.cache_dir)

    def with_prepare_script(self) -> "Sealed":
        files = {**self.files, self.paths.prepare_script: render_prepare_sbatch(self.cfg, self.paths, self.env)}
        _check_script_syntax(self.cfg, files[self.paths.prepare_script])
        return replace(self, files=files)


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


@dataclass
class Shared:
    """What the points of one sweep (jobs/runs/arrays.py) share, resolved once for all of them: the
    image pin (by the container and image settings), the code snapshot (by train.script) and the
    batch script's syntax (by launch.pre_launch, the only text of it a user writes)."""

    pins: dict[str, tuple[ImagePin, list[str], Optional[ConfigError]]] = field(default_factory=dict)
    codes: dict[Optional[str], Snapshot] = field(default_factory=dict)
    parsed: dict[tuple[str, ...], None] = field(default_factory=dict)


def _once(cache: Optional[dict], key, make: Callable[[], Any]) -> Any:
    if cache is None:
        return make()
    return cache[key] if key in cache else cache.setdefault(key, make())


def seal(cfg: Config, project_dir: Path, *, dry_run: bool = False, shared: Optional[Shared] = None,
         config_text: bool = True) -> Sealed:
    """Resolve a submission of `cfg`, nothing written (a dry run goes on without an image: `_pin`);
    without `config_text` config.yaml is left for the caller to add where needed (a sweep's thousands)."""
    paths = RunDir(runs_root(project_dir) / cfg.run.name, project_dir.absolute())
    cfg = resolve_paths(cfg, paths)
    notes: list[str] = []
    pin = _pin(cfg, paths, shared, dry_run, notes)
    code = _once(shared and shared.codes, cfg.train.script, lambda: plan_snapshot(
        paths.path.parent / CODE_STORE, cfg.train.script, paths.project)) if cfg.code.snapshot else None
    if code is not None and code.untracked:
        shown = ", ".join(code.untracked[:5]) + (f" and {len(code.untracked) - 5} more" if len(code.untracked) > 5 else "")
        notes.append(f"not in the code snapshot, as git does not track them: {shown} (`git add` what the run needs)")
    env = run_environment(cfg, paths, pin, code.value if code else None)
    exclusions = plan_exclusions(cfg, paths.path.parent)  # the bad nodes the cluster remembers
    notes += exclusions.notes
    warm = warm_ranks.plan(cfg, paths, lambda where: run_environment(cfg, where, pin), code.value if code else None,
                           f"{pin.identity} {pin.size} {pin.mtime}")
    script = render_sbatch(cfg, paths, env, pin.pins(code.value if code else None, kept_build(cfg, pin),
                                                     container_project(cfg, paths.project)), exclusions.nodes, warm)
    # What else the script holds is rendered and quoted by slipway: one parse per pre_launch text.
    _once(shared and shared.parsed, tuple(cfg.launch.pre_launch), lambda: _check_script_syntax(cfg, script))
    files = {**({paths.config: dump_config(cfg)} if config_text else {}), paths.job_script: script,
             **library_files(env, paths)}
    if env.in_container:
        files[paths.env_toml] = render_edf(env)
        if env.runtime == "pyxis":
            notes += [f"pyxis: {w}" for w in srun_flags(env, paths.env_toml).warnings]
    return Sealed(cfg, paths, pin, env, files, notes, code, exclude=exclusions.nodes)


def _pin(cfg: Config, paths: RunDir, shared: Optional[Shared], dry_run: bool, notes: list[str]) -> ImagePin:
    """The image pin (`pin_image`), once per sweep; a dry run notes a refusal and uses `make image`'s path."""
    # What pin_image reads: container and image settings, the image's needs, whether code is snapshotted.
    pin_key = json.dumps([to_dict(cfg.container), to_dict(cfg.image), repr(cfg.image_needs), cfg.code.snapshot],
                         default=str)
    def found() -> tuple[Optional[ImagePin], list[str], Optional[ConfigError]]:
        pinned: list[str] = []
        try:
            return pin_image(cfg, paths.project, pinned), pinned, None
        except ConfigError as exc:
            return None, pinned, exc
    pin, pin_notes, refused = _once(shared and shared.pins, pin_key, found)
    notes += pin_notes
    if refused is None:
        return pin
    if not dry_run:
        raise refused
    notes.append(f"a real submission would fail: {refused}")
    link = resolve_path(paths.project, cfg.image.output_dir) / f"{cfg.image.name}.sqsh"
    return ImagePin(cfg.container.image, cfg.container.image or str(link), "none")


def no_world_write() -> int:
    """Mask o+w in this process's umask for good, so that nothing it and its children create (runs,
    logs/, history/, checkpoints; a job sbatch submits, as Slurm applies the submitter's umask) is
    writable by every user, even under umask 000; the umask now in force."""
    umask = os.umask(0) | 0o002
    os.umask(umask)
    return umask


def _mode(paths: RunDir, path: Path) -> int:
    """job.sbatch runs; a pinned library (lib/, by hash) is never edited; the rest is data."""
    return 0o755 if path == paths.job_script else 0o444 if path.parent == paths.lib else 0o644


def prepare_run(sealed: Sealed, *, force: bool = False, asked: Optional[dict[str, slurm.JobInfo]] = None,
                git: Optional[dict] = None) -> tuple[Run, bool]:
    """Create `runs/RUN/`, or reuse it (`_refresh`); (run, created). `asked`: what Slurm said of its
    launches, where the caller asked for many runs (a sweep); `git`: the checkout's state, if known."""
    cfg, paths, files = sealed.cfg, sealed.paths, sealed.files
    run = Run(paths)
    no_world_write()
    if run_exists(paths.path):
        _refresh(sealed, run, force, asked)
        return run, False
    root = paths.path.parent
    root.mkdir(parents=True, exist_ok=True)
    if sealed.code is not None:
        sealed.code.write()
    tmp = Path(tempfile.mkdtemp(prefix=f".{cfg.run.name}.", suffix=".tmp", dir=root))
    try:
        # mkdtemp makes 0700: the user's umask instead (teammates read runs), never writable by others.
        os.chmod(tmp, 0o777 & ~no_world_write())
        staged = RunDir(tmp)
        for target, text in files.items():
            write_atomic(tmp / target.relative_to(paths.path), text, _mode(paths, target))
        staged.logs.mkdir()
        manifests.write(staged.manifest, Manifest(
            run=cfg.run.name, created=now_iso(), project_dir=str(paths.project),
            git=git_state(paths.project) if git is None else git,
            image=sealed.pin, runtime=cfg.container.runtime, launcher=cfg.launcher,
            config_sha256=hashlib.sha256(files[paths.config].encode()).hexdigest()))
        try:
            # rename(2) onto a missing name: two submissions racing for one name cannot both win.
            os.rename(tmp, paths.path)
        except OSError:
            raise ConfigError("run.name", f"run {cfg.run.name} was created by another submission just now: "
                                          "submit again to resume it, or pick another --run-name") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return run, True


def _refresh(sealed: Sealed, run: Run, force: bool, asked: Optional[dict[str, slurm.JobInfo]]) -> None:
    """An existing run's files rewritten for a launch, each earlier version kept in history/: never
    under a queued or running job (which reads them), nor for a different config without `force`."""
    cfg, paths, files = sealed.cfg, sealed.paths, sealed.files
    mode = paths.path.stat().st_mode
    if mode & 0o002:  # made under umask 000 before slipway masked it
        os.chmod(paths.path, mode & 0o7775)
    active = active_jobs(run, asked)
    if active:
        jobs = ", ".join(f"{j} ({state})" for j, state in active)
        raise ConfigError("run.name", f"run {cfg.run.name} has a job queued or running ({jobs}), which reads "
                                      f"its files: wait for it to end or `slipway cancel {cfg.run.name}` first")
    differs = config_difference(paths.config, files[paths.config])
    if differs and not force:
        raise ConfigError("run.name", f"run {cfg.run.name} exists with {differs} in {paths.config}: pick "
                                      "another --run-name, or pass --force to replace its config (the old "
                                      "one is kept in history/)")
    if sealed.code is not None:
        sealed.code.write()  # before job.sbatch names it; content-addressed, so never rewritten
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    for target, text in files.items():
        try:
            old: Optional[str] = read_text_bounded(target, target.name)
        except FileNotFoundError:
            old = None
        if old is not None and old != text:
            stem, dot, ext = target.name.partition(".")
            write_atomic(paths.history / f"{stem}-{stamp}{dot}{ext}", old)
            if target == paths.config and differs:
                sealed.replaced = (f"{differs}{_train_on(cfg, paths.path) if 'train.steps ' in differs else ''}"
                                   f"; the old one is in {paths.history / f'{stem}-{stamp}{dot}{ext}'}")
        write_atomic(target, text, _mode(paths, target))


def _train_on(cfg: Config, run_dir: Path) -> str:
    """What the learning rate does where train.steps changed on a run past its warm-up
    (trainer/optim.py `Schedule`): it goes on from the value it reached, never back up."""
    steps, t = complete_checkpoints(run_dir / cfg.checkpoint.dir), cfg.train
    if not steps or steps[-1] <= t.warmup_steps:
        return ""
    then = ("stays there" if "constant" in (t.train_on, t.decay) else f"decays ({t.decay}) from there to "
            f"train.min_lr {t.min_lr:g} at step {t.steps}")
    return f"; the learning rate goes on from its value at step {steps[-1]} and {then} (train.train_on: {t.train_on})"


def record_submission(run: Run, job_id: str, sealed: Sealed, kind: str = "train", after: str = "",
                      git: Optional[dict] = None) -> None:
    """The job in the run's manifest (`git`: the checkout's state, where the caller knows it)."""
    script = run.paths.prepare_script if kind == "prepare" else run.paths.job_script
    entry = Launch(job_id=job_id, kind=kind, submitted=now_iso(), after=after,
                   git=git_state(run.paths.project) if git is None else git,
                   image=sealed.pin, code=sealed.snapshot, steps=sealed.cfg.train.steps if kind == "train" else None,
                   script_sha256=hashlib.sha256(script.read_bytes()).hexdigest(),
                   job_lib=sealed.job_lib if kind == "train" else {},
                   cluster=sealed.cfg.cluster.record() if sealed.cfg.cluster is not None else {})

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
    write_atomic(run.paths.history / f"code-{stamp}.json",
                 json.dumps({"before": before.record() if before else None,
                             "after": after.record() if after else None}, indent=2) + "\n")


def unprepared_data(sealed: Sealed, config_args: str) -> Optional[str]:
    """Why the run cannot start on its token cache as it is, else None; the hint repeats `config_args`."""
    status = sealed.data_status()
    if status.prepared or status.tokenize_in_job:
        return None
    missing = "; ".join(e.describe() for e in status.missing)
    # The fix first: a message too long for one line keeps its start and its end.
    return (f"the token cache is not prepared: run `slipway prepare {config_args}` first (here, or with "
            "--as-job on a CPU node), or submit with --prepare to queue the preparation before the training job; "
            f"data.tokenize_in_job: true lets rank 0 tokenize in the job while every GPU waits; {missing}")


def preparation(cfg: Config, project_dir: Path) -> tuple[Sealed, str]:
    """What `slipway prepare` (here) works from, nothing written: the sealed config and HF_HOME (`hf_home`)."""
    sealed = seal(cfg, project_dir, dry_run=True)
    return sealed, hf_home(cfg, sealed.paths)


def nothing_to_train(cfg: Config, run_dir: Path, command: str) -> Optional[str]:
    """Why a launch would train nothing (a checkpoint reached train.steps), else None; the hint repeats `command`."""
    steps = complete_checkpoints(run_dir / cfg.checkpoint.dir)
    if not steps or steps[-1] < cfg.train.steps:
        return None
    more = cfg.config_args_setting({"train.steps": steps[-1] + cfg.train.steps})
    return (f"run {cfg.run.name} already reached train.steps={cfg.train.steps} (checkpoint at step {steps[-1]}): "
            f"nothing to train; to train on, `{environ.invocation()} {command} {more} --force` (a changed config: the "
            "old one is kept in history/), or pick another --run-name for a new run")


def submit(cfg: Config, project_dir: Path, *, force: bool = False, prepare: bool = False,
           before_writing: Optional[Callable[[], None]] = None) -> tuple[Run, str, Sealed, Optional[str]]:
    """Seal the submission, write the run directory and `sbatch` it; returns (run, job id, sealed,
    the preparation job's id or None). A token cache not prepared is refused unless `prepare`:
    then a CPU job prepares it and the training job starts after that one completed."""
    check_submittable(cfg)
    sealed = seal(cfg, project_dir)
    done = nothing_to_train(cfg, sealed.paths.path, "submit")
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
    with runlock.hold(sealed.paths.path, f"slipway submit {cfg.config_args}"):
        return _submit_locked(sealed, force=force, why=why)


def _submit_locked(sealed: Sealed, *, force: bool, why: Optional[str],
                   train: bool = True) -> tuple[Run, str, Sealed, Optional[str]]:
    """Write the run directory, then sbatch the data preparation job (`why` it is needed) and the
    training job after it (unless not `train`); returns (run, the last job's id, sealed, the
    preparation job's id or None). What a refusal leaves is what it found."""
    made = create_needed_dirs(sealed.cfg, sealed.paths)
    try:
        run, created = prepare_run(sealed, force=force)
    except BaseException:  # refused (a running job, a different config): leave no directory behind
        remove_created_dirs(made)
        raise
    prep_id = None
    try:
        if why:
            prep_id = slurm.sbatch(run.paths.prepare_script, cwd=run.paths.project)
            record_submission(run, prep_id, sealed, kind="prepare")
        job_id = slurm.sbatch(run.paths.job_script, cwd=run.paths.project, after=prep_id) if train else prep_id
    except BaseException:
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
    if train:
        record_submission(run, job_id, sealed, after=prep_id or "")
    return run, job_id, sealed, prep_id


def submit_prepare(cfg: Config, project_dir: Path, *, force: bool = False) -> tuple[Run, str, Sealed]:
    """`slipway prepare --as-job`: the run's data preparation as a CPU job of its own."""
    check_submittable(cfg)
    sealed = seal(cfg, project_dir).with_prepare_script()
    with runlock.hold(sealed.paths.path, f"slipway prepare {cfg.config_args} --as-job"):
        run, job_id, sealed, _ = _submit_locked(sealed, force=force, why="--as-job", train=False)
    return run, job_id, sealed
