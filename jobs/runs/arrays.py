"""A sweep planned (every point built, checked and sealed before anything is written) and queued
as Slurm job arrays (jobs/runs/sweep.py is what a sweep is).

Points are sealed and written by the submit path; the sweep is sealed once (`Shared`: one image
pin, one code snapshot). One `sbatch --array` per allocation asked and per MaxArraySize: task I of
arrays/STAMP/array.sbatch runs its point's own job.sbatch, and STAMP/I links to the point's run
directory so that Slurm writes the task's log into that run's logs/ (an array has one --output).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shlex
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

from common.errors import ConfigError, shown
from common.events import now_iso
from common.fs import write_atomic
from common.rundir import RunDir
from common.schema import config_fields, to_dict
from edf.environment import SAFE_NAME
from jobs import slurm
from jobs.config import Config, dump_config
from jobs.runs import lifecycle
from jobs.runs import lock as runlock
from jobs.runs import manifest as manifests
from jobs.runs.code import git_state
from jobs.runs.container import create_needed_dirs, remove_created_dirs, resolve_paths
from jobs.runs.run import Run, Unreadable, many_objects, run_exists, runs_root
from jobs.runs.checks import check_submittable, config_difference
from jobs.runs.submit import (Sealed, Shared, nothing_to_train, no_world_write, prepare_run, record_submission, seal,
                              unprepared_data)
from jobs.runs.sweep import (NAME_ROOM, Axis, ArrayJob, Point, Sweep, Variants, find_sweep, grid, point_names,
                             read_points, split_axes, sweep_dir, value_text, write_sweep)
from jobs.slurm.script import sbatch_header, sbatch_quote
from trainer.config import TrainerConfig

# A point's, in this order; UNREADABLE: its run cannot be read (damaged, a teammate's), left as it is.
NEW, RESUME, FINISHED, ACTIVE, UNREADABLE = "new", "to resume", "finished", "queued or running", "unreadable"


@dataclass(eq=False)  # a point's plan is itself: compared by identity
class PointPlan:
    point: Point
    sealed: Sealed
    state: str  # NEW, RESUME, ACTIVE, FINISHED
    key: Optional[tuple] = None  # its manifest's file key when Slurm was asked (unchanged: the answer holds)

    @property
    def cfg(self) -> Config:
        return self.sealed.cfg


@dataclass
class Plan:
    sweep: Sweep  # the record as it will be written: earlier points, then the new ones
    points: list[PointPlan]  # this command's points
    refusals: list[ConfigError] = field(default_factory=list)  # what refuses the submission
    notes: list[str] = field(default_factory=list)
    asked: dict = field(default_factory=dict)  # what Slurm said of the points' launches
    git: dict = field(default_factory=dict)

    @property
    def to_submit(self) -> list[PointPlan]:
        return [p for p in self.points if p.state in (NEW, RESUME)]


def plan_sweep(variants: Variants, config: str, overrides: list[str], project_dir: Path, *,
               name: Optional[str] = None, points_file: Optional[str] = None, given_args: str = "",
               dry_run: bool = False, force: bool = False,
               view: Optional[Callable[[Config], Config]] = None) -> Plan:
    """Every point built, validated and sealed, nothing written (one bad point: a ConfigError naming
    it); what would refuse the submission (an unrelated run of a point's name, a changed config,
    data not prepared) goes to `refusals`. `view`: how a point runs here (`slipway sweep --local`)."""
    axes, plain = split_axes(overrides)
    entries = read_points(points_file) if points_file else None
    base = variants.base
    name = name or base.run.name
    if not SAFE_NAME.fullmatch(name) or len(name) > NAME_ROOM:
        raise ConfigError("--name", f"{shown(name)} is no sweep name: use 1-{NAME_ROOM} letters, digits, '.', '_' "
                                    "or '-', starting with a letter or digit")
    if RunDir(runs_root(project_dir) / name).manifest.is_file():
        raise ConfigError("--name", f"{name} is a run, not a sweep: give the sweep another --name")
    settings = grid(axes, entries)
    names = point_names(name, settings)
    old = find_sweep(name, project_dir)
    known = {p.run for p in old.points} if old else set()
    exists = _lister()
    keys = sorted({k for values in settings for k in values})
    # A point's own arguments (what a hint repeats, `slipway local ...`): the axes' items replaced by its values.
    swept = [o for o in overrides if o not in plain]
    words = [w for w in shlex.split(given_args or config) if w not in swept]
    with many_objects():
        plans, refusals = _points(variants, zip(settings, names), keys, words, project_dir,
                                  lambda sealed: _unrelated(sealed, name, known, exists), dry_run=dry_run, view=view)
    plan = Plan(_merged(old, name, base, axes, given_args, [p.point for p in plans]), plans, refusals)
    plan.notes = list(dict.fromkeys(n for p in plans for n in p.sealed.notes))
    if not refusals:
        _existing(plan, force, exists)
        _data(plan, dry_run)
    plan.git = git_state(project_dir)
    return plan


def _data(plan: Plan, dry_run: bool) -> None:
    """The first point to submit whose data is not prepared refuses the submission."""
    refused: dict[str, Optional[str]] = {}
    texts: dict[int, str] = {}  # the data section's text, by the section (points share one an axis leaves alone)
    for p in plan.to_submit:
        if not dry_run:
            _frozen(p)
        d = p.cfg.data
        key = texts.get(id(d)) or texts.setdefault(id(d), json.dumps(to_dict(d), default=str))
        if key not in refused:  # its paths resolved (a dry run leaves those of a point it does not seal)
            refused[key] = unprepared_data(replace(p.sealed, cfg=resolve_paths(p.cfg, p.sealed.paths)),
                                           p.cfg.config_args)
        if refused[key]:
            plan.refusals.append(ConfigError(f"point {p.point.run}", f"data: {refused[key]}"))
            break


def _points(variants: Variants, points: Iterable[tuple[dict[str, Any], str]], keys: list[str], words: list[str],
            project_dir: Path, unrelated: Callable[[Sealed], None], *, dry_run: bool,
            view: Optional[Callable[[Config], Config]]) -> tuple[list[PointPlan], list[ConfigError]]:
    """Each point built, checked and sealed (in a dry run, as `_fresh` says); the refusals."""
    shared, seen, plans, refusals = Shared(), {}, [], []
    first, sealed_values, checked, given = None, set(), {}, shlex.join(words)
    for values, run_name in points:
        point = Point(run_name, values)
        try:
            cfg = variants(values, run_name)
            cfg.given_args = f"{given} " + shlex.join([*(f"{k}={value_text(v)}" for k, v in values.items()),
                                                       "--run-name", run_name])
            cfg = view(cfg) if view else cfg
            for stream in ("output", "error"):
                if "%x" in getattr(cfg.slurm, stream).replace("%%", ""):
                    raise ConfigError(f"slurm.{stream}", "%x is the array's job name in a sweep, not the point's: "
                                                         "use %j (the task's ARRAY_TASK id) or a fixed name")
            if dry_run and first is not None and not _fresh(values, sealed_values):  # built and checked; its
                sealed = replace(first, cfg=cfg, paths=RunDir(first.paths.path.parent / run_name, first.paths.project),
                                 files={}, notes=[])  # files rendered when submitted
            else:
                sealed = first = seal(cfg, project_dir, dry_run=dry_run, shared=shared, config_text=False)
        except ConfigError as exc:
            raise ConfigError(f"point {run_name}", f"{exc} ({point.label(120)})") from None
        same = tuple(repr(variants.typed(cfg, key, values.get(key))) for key in keys)  # the values typed by their fields
        if same in seen:
            raise ConfigError(f"point {run_name}", f"has the same config as point {seen[same]} ({point.label(120)}): "
                                                   "drop one of the two")
        seen[same] = run_name
        plans.append(PointPlan(point, sealed, NEW))
        # What it reads (the container's and Slurm's sections, train.script): once for the points that share them.
        on_disk = (id(cfg.container), id(cfg.slurm), cfg.train.script)
        if on_disk not in checked:
            checked[on_disk] = _refused(lambda: check_submittable(cfg))
        refusals += [ConfigError(f"point {run_name}", why) for why in
                     (checked[on_disk], _refused(lambda: unrelated(sealed))) if why]
    return plans, refusals


def _refused(check: Callable[[], None]) -> str:
    """What `check()` refuses ("": nothing)."""
    try:
        check()
    except ConfigError as exc:
        return str(exc)
    return ""


# The host's sections (slurm, container, launch, image, code): what a job's files and pins come from.
_HOST = set(config_fields(Config)) - set(config_fields(TrainerConfig))


def _fresh(values: dict[str, Any], sealed: set[tuple[str, str]]) -> bool:
    """Whether a dry run seals a point: the first giving a host section's field a new value (`sealed` notes it)."""
    new = {(k, repr(v)) for k, v in values.items() if k.partition(".")[0] in _HOST} - sealed
    sealed |= new
    return bool(new)


def _unrelated(sealed: Sealed, sweep: str, known: set[str], exists: Callable[[Path], bool]) -> None:
    if sealed.cfg.run.name not in known and exists(sealed.paths.path):
        raise ConfigError("run.name", f"{sealed.paths.path} exists and is no point of sweep {sweep}: move it aside, "
                                      "or give the sweep another --name")


def _merged(old: Optional[Sweep], name: str, base: Config, axes: list[Axis], given: str, points: list[Point]) -> Sweep:
    sweep = old or Sweep(name=name, created=now_iso())
    have = {p.run for p in sweep.points}
    sweep.points = [*sweep.points, *(p for p in points if p.run not in have)]
    sweep.axes = list(dict.fromkeys([*sweep.axes, *(a.key for a in axes), *(k for p in points for k in p.values)]))
    sweep.config = given or base.config_args
    return sweep


def _lister() -> Callable[[Path], bool]:
    """`exists(path)` (lexists) for thousands of points' runs: each folder listed once."""
    folders: dict[str, Optional[set[str]]] = {}

    def exists(path: Path) -> bool:
        parent, name = os.path.split(str(path))  # strings: a Path's parent is a new Path each time
        if parent not in folders:
            try:
                folders[parent] = set(os.listdir(parent))
            except FileNotFoundError:
                folders[parent] = set()
            except OSError:  # not listable: each path asked on its own
                folders[parent] = None
        names = folders[parent]
        return os.path.lexists(path) if names is None else name in names
    return exists


def _existing(plan: Plan, force: bool, exists: Callable[[Path], bool]) -> None:
    """Each point whose run exists: queued or running, finished, to resume (a changed config refused
    without `force`), or unreadable (damaged, a teammate's) and left with a note; Slurm asked once."""
    there = []
    for p in plan.points:
        run = Run(p.sealed.paths)
        try:
            if exists(run.dir) and run_exists(run.dir, f"point {p.point.run}"):
                launches = run.launches()
                there.append((p, run, manifests.file_key(run.paths.manifest), launches, run.events()))
        except (ConfigError, OSError) as exc:  # that point alone
            p.state = UNREADABLE
            why = str(exc) if type(exc) is ConfigError else Unreadable.of(run.dir, exc).line()
            plan.notes.append(f"{why}: left as it is, not submitted")
    owns = {id(x): run.events_of(x, events) for _, run, _, launches, events in there for x in launches}
    plan.asked = lifecycle.ask_slurm((x, owns[id(x)]) for *_, launches, _ in there for x in launches if not x.local)
    changed = []
    for p, run, key, launches, _ in there:
        p.key = key
        train = [x for x in launches if x.kind == "train"]
        last = lifecycle.launch_state(train[-1], owns[id(train[-1])], plan.asked.get(train[-1].id)) if train else None
        if any(x.id in plan.asked and plan.asked[x.id].active for x in launches):
            p.state = ACTIVE
        elif nothing_to_train(p.cfg, run.dir, "sweep") or (
                last is not None and last.state == lifecycle.COMPLETED and train[-1].steps == p.cfg.train.steps):
            p.state = FINISHED
        else:
            p.state = RESUME
            differs = config_difference(run.paths.config, _frozen(p))
            if differs and not force:
                changed.append((p.point.run, differs))
    if changed:
        more = f" (and {len(changed) - 1} more point(s))" if len(changed) > 1 else ""
        plan.refusals.append(ConfigError(f"point {changed[0][0]}", f"exists with {changed[0][1]}{more}: pass --force "
                                                                   "to replace their configs (the old ones are kept "
                                                                   "in history/)"))


def _frozen(p: PointPlan) -> str:
    """The point's config.yaml, made (into its files) only for points written or compared: a thousand cost seconds."""
    path = p.sealed.paths.config
    if path not in p.sealed.files:
        p.sealed.files[path] = dump_config(resolve_paths(p.cfg, p.sealed.paths))  # resolved: a dry run may not have
    return p.sealed.files[path]


def allocation(sealed: Sealed) -> tuple[str, ...]:
    """The #SBATCH lines a point's array shares: its job.sbatch header's but its name and logs, rendered alike."""
    lines = [line for line in sbatch_header(sealed.cfg, sealed.paths, sealed.exclude) if line.startswith("#SBATCH ")]
    mine = ("--job-name=", "--output=", "--error=")
    s = sealed.cfg.slurm
    return (*(line for line in lines if not line[8:].startswith(mine)), f"#output {s.output}", f"#error {s.error}")


def arrays_of(points: list[PointPlan], limit: int) -> list[list[PointPlan]]:
    """The points in arrays, one per allocation asked, each of at most `limit` tasks (MaxArraySize:
    task indices stay below it; 0, a site without job arrays: each point a job of its own)."""
    groups: dict[tuple, list[PointPlan]] = {}
    asks: dict[tuple, tuple] = {}  # by what a header reads (points share sections an axis leaves alone)
    for p in points:
        cfg = p.cfg
        key = (id(cfg.slurm), id(cfg.launch), cfg.train.script, tuple(p.sealed.exclude))
        groups.setdefault(asks[key] if key in asks else asks.setdefault(key, allocation(p.sealed)), []).append(p)
    return [g[i:i + (limit or 1)] for g in groups.values() for i in range(0, len(g), limit or 1)]


# The most tasks of one array that run at once unless --max-parallel says (submitit's default too):
# a sweep of ten thousand points does not take a whole cluster at once by default.
MAX_PARALLEL = 256


def array_spec(tasks: int, max_parallel: Optional[int]) -> str:
    """`--array=`'s value for `tasks` tasks: `0-N%K`, K the tasks that run at once."""
    return f"0-{tasks - 1}%{max_parallel or min(tasks, MAX_PARALLEL)}"


def _array_pattern(pattern: str) -> str:
    """A point's log pattern as its task's: %j, the job id, becomes the task's ARRAY_TASK."""
    return pattern.replace("%%", "\0").replace("%j", "%A_%a").replace("\0", "%%")


def render_array(sweep: str, where: Path, points: list[PointPlan], max_parallel: Optional[int]) -> str:
    """The array's batch script: the shared allocation lines, the array, and task I running `where/I`'s job.sbatch."""
    first = points[0].sealed
    s = first.cfg.slurm
    own = [line for line in allocation(first) if line.startswith("#SBATCH ")]
    return "\n".join([
        "#!/bin/bash",
        f"# slipway sweep {sweep}: {len(points)} point(s) as one Slurm job array; generated. Task I runs",
        "# POINTS[I] by its own batch script, runs/POINT/job.sbatch, whose allocation lines these are;",
        "# I/ beside this script links to that run, so the task's log is the run's own.",
        f"#SBATCH --job-name={sweep}",
        *own,
        f"#SBATCH --output={sbatch_quote(str(where / '%a' / _array_pattern(s.output)))}",
        f"#SBATCH --error={sbatch_quote(str(where / '%a' / _array_pattern(s.error)))}",
        f"#SBATCH --array={array_spec(len(points), max_parallel)}",
        "",
        "set -euo pipefail",
        "POINTS=(" + " ".join(shlex.quote(p.point.run) for p in points) + ")",
        'POINT=${POINTS[$SLURM_ARRAY_TASK_ID]}',
        "# The task's events and manifest entry name it ARRAY_TASK, as squeue and scancel do; its",
        "# SLURM_JOB_ID is its own, which its requeues and exclusions act on.",
        'export SLIPWAY_EVENT_JOB="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"',
        f'exec /bin/bash {shlex.quote(str(first.paths.path.parent))}/"$POINT"/job.sbatch',
        "",
    ])


def _write_array(sweep: str, home: Path, points: list[PointPlan], max_parallel: Optional[int]) -> Path:
    """arrays/STAMP/: the array's script and links I -> task I's run directory, renamed into place whole."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    arrays = home / "arrays"
    arrays.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{stamp}-", dir=arrays))
    final = arrays / tmp.name[1:]
    try:
        for i, p in enumerate(points):
            os.symlink(os.path.relpath(p.sealed.paths.path, final), tmp / str(i))
        write_atomic(tmp / "array.sbatch", render_array(sweep, final, points, max_parallel), 0o755)
        os.chmod(tmp, 0o777 & ~no_world_write())
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final / "array.sbatch"


def _open_files_for(n: int) -> None:
    """Room for `n` more open files (a lock per point is held while the arrays are submitted)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))


def submit_sweep(plan: Plan, project_dir: Path, *, force: bool = False, max_parallel: Optional[int] = None,
                 before_writing: Optional[Callable[[], None]] = None) -> list[ArrayJob]:
    """Write the record, the points' run directories and arrays, and sbatch each array, under the
    caller's sweep lock (`hold`) and each point's, from its directory's writing to its job's record."""
    if plan.refusals:
        raise plan.refusals[0]
    home = sweep_dir(project_dir, plan.sweep.name)
    todo = plan.to_submit
    if before_writing is not None and todo:
        before_writing()
    limit = slurm.max_array_size() if todo else 1
    no_world_write()
    write_sweep(home / "sweep.json", plan.sweep)
    if not todo:
        return []
    _open_files_for(len(todo))
    submitted: list[ArrayJob] = []
    with contextlib.ExitStack() as held:
        for p in todo:
            held.enter_context(runlock.hold(p.sealed.paths.path, f"slipway sweep {plan.sweep.config}"))
        for chunk in arrays_of(todo, limit):
            made: list[tuple[PointPlan, bool, list[Path]]] = []
            try:
                for p in chunk:
                    unchanged = manifests.file_key(p.sealed.paths.manifest) == p.key
                    dirs = create_needed_dirs(p.cfg, p.sealed.paths)
                    _, created = prepare_run(p.sealed, force=force, asked=plan.asked if unchanged else None,
                                             git=plan.git)
                    made.append((p, created, dirs))
                # A site without arrays (MaxArraySize 0): the point's own job.sbatch, as `submit` queues it.
                script = (_write_array(plan.sweep.name, home, chunk, max_parallel) if limit
                          else chunk[0].sealed.paths.job_script)
                job = slurm.sbatch(script, cwd=project_dir)
            except BaseException:
                for p, created, dirs in made:  # nothing of this array ran: no trace of its new runs
                    remove_created_dirs(dirs)
                    if created:
                        shutil.rmtree(p.sealed.paths.path, ignore_errors=True)
                raise
            for i, p in enumerate(chunk):
                record_submission(Run(p.sealed.paths), f"{job}_{i}" if limit else job, p.sealed, git=plan.git)
            array = ArrayJob(job, [p.point.run for p in chunk], os.path.relpath(script, home), now_iso(), max_parallel)
            plan.sweep.arrays.append(array)
            submitted.append(array)
            write_sweep(home / "sweep.json", plan.sweep)
    return submitted


@contextlib.contextmanager
def hold(project_dir: Path, name: str, command: str) -> Iterator[None]:
    """The sweep's lock (runs/.sweeps/.NAME.lock, the runs' own kind): one `slipway sweep` or
    `cancel` of it at a time; a second waits for a short holder, and is refused naming it. A refused
    first sweep leaves no runs/ behind (`runlock.hold`)."""
    where = sweep_dir(project_dir, name)
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(runlock.hold(where, command))
        except ConfigError:
            raise ConfigError("--name", f"sweep {name} is being submitted, run or cancelled by "
                                        f"{runlock.describe(runlock.holder(where))}: try again once it is done") from None
        yield
