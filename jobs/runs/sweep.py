"""A sweep: a set of runs from one config and the values that vary, queued as Slurm job arrays.

Each point is a run (runs/POINT/), sealed and written by the submit path (jobs/runs/submit.py
`seal`, `prepare_run`, `record_submission`): every command takes a point by its run name, and
every single-run guarantee holds per point. The sweep adds what groups them: its record,
runs/.sweeps/SWEEP/sweep.json (its axes, its points with their values, its arrays), written
atomically under the sweep's lock; and one small batch script per array, arrays/STAMP/array.sbatch,
whose task I runs its point's own job.sbatch. Beside it, STAMP/I links to the point's run
directory, so that Slurm writes each task's log into that run's logs/ (an array has one --output).

A task's SLURM_JOB_ID is its own (requeues and `scontrol update` act on it alone); its events and
its manifest entry name it ARRAY_TASK, as squeue and scancel do (SLIPWAY_EVENT_JOB).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import re
import resource
import shlex
import shutil
import tempfile
import types
import typing
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Optional, get_args, get_origin

from common.errors import ConfigError, bounded, bounded_path, shown
from common.events import now_iso
from common.fs import open_regular, write_atomic
from common.rundir import RunDir
from common.schema import from_dict, to_dict
from common.yaml import read_text_bounded, read_yaml
from edf.environment import SAFE_NAME
from jobs import slurm
from jobs.config import MAP_FIELDS, Config, config_from, parse_value, read_config
from jobs.runs import lifecycle
from jobs.runs import lock as runlock
from jobs.runs import manifest as manifests
from jobs.runs.code import git_state
from jobs.runs.container import create_needed_dirs, remove_created_dirs
from jobs.runs.manifest import NOT_A_KEY, ManifestError
from jobs.runs.run import Run, runs_root
from jobs.runs.submit import (Sealed, Shared, check_submittable, config_difference, nothing_to_train, no_world_write,
                              prepare_run, record_submission, seal, unprepared_data)
from jobs.slurm.script import sbatch_quote

SWEEPS = ".sweeps"  # runs/.sweeps/SWEEP/: a sweep's record and array scripts (no run directory)
SCHEMA = 1
MAX_BYTES = 32 << 20
NAME_ROOM = 60  # a sweep's name leaves its points' values room in a run name's 100 characters
NEW, RESUME, FINISHED, ACTIVE = "new", "to resume", "finished", "queued or running"  # a point's, in this order


class SweepError(ConfigError):
    """A sweep record that cannot be read: one line naming the file and what to do."""

    def __init__(self, path: Path, why: str):
        self.path, self.why = path, why
        super().__init__(bounded_path(path), f"damaged ({why}): slipway cannot tell this sweep's points and arrays "
                                             f"from it; restore it from a backup, or move {path.parent.name} aside "
                                             f"(its points stay runs of their own: `slipway status` lists them)")


@dataclass(frozen=True)
class Point:
    """A point of a sweep: its run's name and the values it sets (dotted key -> as given)."""

    run: str = ""
    values: dict = field(default_factory=dict)
    others: dict = field(default_factory=dict, compare=False, repr=False, metadata=NOT_A_KEY)

    ALWAYS: ClassVar[tuple[str, ...]] = ("*",)

    def label(self, limit: int = 0) -> str:
        """`lr=0.001 micro_batch_size=8`: the values by their shortest distinct key."""
        text = " ".join(f"{k}={value_text(v)}" for k, v in zip(short_keys(list(self.values)), self.values.values()))
        return text if not limit or len(text) <= limit else text[:limit - 3] + "..."


@dataclass
class ArrayJob:
    """One `sbatch --array` of a sweep: its job id and its points, by task index."""

    job_id: str = ""
    points: list[str] = field(default_factory=list)
    script: str = ""  # relative to the sweep's directory
    submitted: str = ""
    max_parallel: Optional[int] = None
    others: dict = field(default_factory=dict, compare=False, repr=False, metadata=NOT_A_KEY)

    ALWAYS: ClassVar[tuple[str, ...]] = ("*",)


@dataclass
class Sweep:
    """runs/.sweeps/SWEEP/sweep.json."""

    schema: int = SCHEMA
    name: str = ""
    created: str = ""
    config: str = ""  # the config arguments it was last given (CONFIG, overrides, flags)
    axes: list[str] = field(default_factory=list)  # the keys it sweeps, in order
    points: list[Point] = field(default_factory=list)
    arrays: list[ArrayJob] = field(default_factory=list)
    others: dict = field(default_factory=dict, repr=False, metadata=NOT_A_KEY)

    ALWAYS: ClassVar[tuple[str, ...]] = ("*",)

    def check(self, where: str) -> None:
        for i, p in enumerate(self.points):
            if not SAFE_NAME.match(p.run):
                raise ConfigError(f"{where}.points[{i}].run", f"{shown(p.run)} is no run name")

    def runs(self, project_dir: Path) -> list[Run]:
        root = runs_root(project_dir)
        return [Run(RunDir(root / p.run, project_dir)) for p in self.points]


# ---------------------------------------------------------------- the record


def sweep_dir(project_dir: Path, name: str) -> Path:
    return runs_root(project_dir) / SWEEPS / name


def find_sweep(name: str, project_dir: Path) -> Optional[Sweep]:
    """The sweep `name` (None: there is none); SweepError when its record cannot be read."""
    if not SAFE_NAME.match(name):
        return None
    path = sweep_dir(project_dir, name) / "sweep.json"
    return read_sweep(path) if path.exists() or path.is_symlink() else None


def list_sweeps(project_dir: Path) -> list[str]:
    root = runs_root(project_dir) / SWEEPS
    return sorted(p.name for p in root.iterdir() if (p / "sweep.json").exists()) if root.is_dir() else []


def read_sweep(path: Path) -> Sweep:
    """The record at `path`, checked by the schema engine; SweepError when it cannot be read."""
    try:
        f = open_regular(path)
        if f is None:
            raise SweepError(path, "missing")
        with f:
            data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise SweepError(path, f"cannot be read: {exc.strerror or exc}") from None
    if len(data) > MAX_BYTES:
        raise SweepError(path, f"larger than {MAX_BYTES >> 20} MiB")
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SweepError(path, f"not JSON: {bounded(str(exc), 120)}") from None
    if not isinstance(raw, dict):
        raise SweepError(path, "not an object")
    if type(raw.get("schema")) is int and raw["schema"] > SCHEMA:
        raise SweepError(path, f"written by a newer slipway (format {raw['schema']})")
    try:
        return from_dict(Sweep, raw, "sweep", record=True)
    except ConfigError as exc:
        raise SweepError(path, str(exc).removeprefix("sweep.")) from None


def write_sweep(path: Path, sweep: Sweep) -> None:
    write_atomic(path, json.dumps(manifests.to_record(sweep), indent=1) + "\n")


# ---------------------------------------------------------------- axes, points and their names


@dataclass(frozen=True)
class Axis:
    key: str
    values: tuple  # each as an override's value parses (what apply_override sets)


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _bare(tp: Any) -> Any:
    """`tp` without its Optional."""
    args = [a for a in get_args(tp) if a is not type(None)]
    return args[0] if get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1 else tp


def field_type(key: str) -> Any:
    """The type of config field `key` (a mapping's values for `container.env.NAME`), None if no field."""
    tp: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        tp = _bare(tp)
        if get_origin(tp) is dict:
            return get_args(tp)[1] if ".".join(parts[:i]) in MAP_FIELDS else None
        if not hasattr(tp, "__dataclass_fields__") or part not in _hints(tp):
            return None
        tp = _hints(tp)[part]
    return _bare(tp)


def typed(cfg: Config, key: str) -> Any:
    """The value of config field `key` in `cfg` (a mapping's entry for `container.env.NAME`)."""
    node: Any = cfg
    parts = key.split(".")
    for i, part in enumerate(parts):
        if isinstance(node, dict):
            return node.get(".".join(parts[i:]))
        node = getattr(node, part, None)
    return node


def split_axes(overrides: list[str]) -> tuple[list[Axis], list[str]]:
    """The axes among `overrides` (KEY=[V1, V2, ...] on a field that is no list, a list field's
    axis being a list of lists) and the plain overrides left."""
    axes, plain = [], []
    for item in overrides:
        key, sep, text = item.partition("=")
        key, stripped = key.strip(), text.strip()
        if not (sep and stripped.startswith("[") and stripped.endswith("]")):
            plain.append(item)
            continue
        if get_origin(field_type(key)) is list:
            parsed = read_yaml(text, key, lines=False)
            if not (isinstance(parsed, list) and parsed and all(isinstance(v, list) for v in parsed)):
                plain.append(item)  # a value of the list field itself
                continue
            values = tuple(parsed)
        else:
            values = tuple(parse_value(text, key))
        if key == "run.name":
            raise ConfigError(key, "a sweep names its points itself: name the sweep with --name")
        if not values:
            raise ConfigError(key, f"an axis needs at least one value: {key}=[V1, V2, ...]")
        if any(a.key == key for a in axes):
            raise ConfigError(key, "swept twice: give its values in one list")
        seen = [value_text(v) for v in values]
        dupes = sorted({t for t in seen if seen.count(t) > 1})
        if dupes:
            raise ConfigError(key, f"the value {dupes[0]} is given twice: each value once")
        axes.append(Axis(key, values))
    return axes, plain


def read_points(path: str) -> list[dict[str, Any]]:
    """--points FILE: a YAML list of override maps (dotted keys, or nested sections), one point each."""
    if not Path(path).is_file():
        raise ConfigError("--points", f"{bounded_path(path)} is no file: give a YAML file of override maps")
    data = read_yaml(read_text_bounded(Path(path), "--points"), path)
    if not isinstance(data, list) or not data:
        raise ConfigError("--points", f"{path} must hold a YAML list of override maps, one point each, such as "
                                      "- {train.lr: 0.001, train.steps: 100}")
    out = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise ConfigError(f"--points[{i}]", f"expected a map of overrides such as {{train.lr: 0.001}}, got "
                                                f"{shown(item)}")
        flat: dict[str, Any] = {}

        def walk(node: dict, prefix: str) -> None:
            for k, v in node.items():
                key = f"{prefix}{k}"
                if isinstance(v, dict) and key not in MAP_FIELDS and field_type(key) is not None \
                        and get_origin(field_type(key)) is not dict:
                    walk(v, key + ".")
                else:
                    flat[key] = v
        walk(item, "")
        if "run.name" in flat:
            raise ConfigError(f"--points[{i}].run.name", "a sweep names its points itself: name the sweep with --name")
        out.append(flat)
    return out


def grid(axes: list[Axis], entries: Optional[list[dict[str, Any]]] = None) -> list[dict[str, Any]]:
    """Every point's settings: each --points entry (or none) with each combination of the axes."""
    points = []
    for i, entry in enumerate(entries or [{}]):
        both = sorted(set(entry) & {a.key for a in axes})
        if both:
            raise ConfigError(f"--points[{i}].{both[0]}", "is also an axis on the command line: set it in one place")
        for combo in itertools.product(*(a.values for a in axes)):
            points.append({**entry, **{a.key: v for a, v in zip(axes, combo)}})
    return points


def value_text(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    return "null" if value is None else str(value)


def short_keys(keys: list[str]) -> list[str]:
    """Each dotted key by its shortest last parts that no other key ends with (`lr`, `model_dropout`)."""
    out = []
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            tail = parts[-n:]
            if n == len(parts) or not any(k != key and k.split(".")[-n:] == tail for k in keys):
                out.append("_".join(tail))
                break
    return out


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def point_names(sweep: str, settings: list[dict[str, Any]]) -> list[str]:
    """Each point's run name: the sweep's, then each value after its short key (`tiny-lr0.001-micro_batch_size8`).
    Stable: it depends on the point's own values alone. A value no run name can hold as it is
    (a path, a list), or a name past 100 characters, is cut and ends in a hash of the values; so
    do names two points would share."""
    keys = list(dict.fromkeys(k for s in settings for k in s))
    labels = dict(zip(keys, short_keys(keys)))

    def digest(s: dict) -> str:
        return hashlib.sha256(json.dumps(sorted((k, value_text(v)) for k, v in s.items())).encode()).hexdigest()[:8]

    def name(s: dict, hashed: bool) -> str:
        words = [f"{labels[k]}{value_text(v)}" for k, v in s.items()] or ["base"]
        body = "-".join(_UNSAFE.sub("_", w) for w in words)
        hashed = hashed or body != "-".join(words) or len(sweep) + 1 + len(body) > 100
        if not hashed:
            return f"{sweep}-{body}"
        return f"{sweep}-{body[:100 - len(sweep) - 10].rstrip('-_.')}-{digest(s)}"

    names = [name(s, False) for s in settings]
    shared = {n for n in names if names.count(n) > 1}
    return [name(s, True) if n in shared else n for s, n in zip(settings, names)]


# ---------------------------------------------------------------- the plan: every point checked


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


def plan_sweep(config: str, overrides: list[str], sets: dict[str, Any], project_dir: Path, *,
               name: Optional[str] = None, points_file: Optional[str] = None, given_args: str = "",
               dry_run: bool = False, force: bool = False, view: Optional[Callable[[Config], Config]] = None) -> Plan:
    """Every point of the sweep built, validated and sealed (nothing written): one bad point is a
    ConfigError naming it. What would refuse the submission (an unrelated run of a point's name, a
    point whose config changed, data not prepared) is in `refusals`. `view`: how a point runs
    here (`slipway sweep --local`), applied to each point's config before it is checked."""
    axes, plain = split_axes(overrides)
    entries = read_points(points_file) if points_file else None
    path, raw = read_config(config)
    base = config_from(path, raw, plain, sets)
    name = name or base.run.name
    if not SAFE_NAME.match(name) or len(name) > NAME_ROOM:
        raise ConfigError("--name", f"{shown(name)} is no sweep name: use 1-{NAME_ROOM} letters, digits, '.', '_' "
                                    "or '-', starting with a letter or digit")
    if RunDir(runs_root(project_dir) / name).manifest.is_file():
        raise ConfigError("--name", f"{name} is a run, not a sweep: give the sweep another --name")
    settings = grid(axes, entries)
    names = point_names(name, settings)
    old = find_sweep(name, project_dir)
    known = {p.run for p in old.points} if old else set()
    shared, seen, plans, refusals = Shared(), {}, [], []
    keys = sorted({k for values in settings for k in values})
    for values, run_name in zip(settings, names):
        point = Point(run_name, values)
        try:
            cfg = config_from(path, raw, plain, sets, {**values, "run.name": run_name})
            cfg.given_args = given_args or None
            cfg = view(cfg) if view else cfg
            for stream in ("output", "error"):
                if "%x" in getattr(cfg.slurm, stream).replace("%%", ""):
                    raise ConfigError(f"slurm.{stream}", "%x is the array's job name in a sweep, not the point's: "
                                                         "use %j (the task's ARRAY_TASK id) or a fixed name")
            sealed = seal(cfg, project_dir, dry_run=dry_run, shared=shared,
                          config_text=not dry_run or RunDir(runs_root(project_dir) / run_name).path.exists())
        except ConfigError as exc:
            raise ConfigError(f"point {run_name}", f"{exc} ({point.label(120)})") from None
        same = tuple(repr(typed(cfg, key)) for key in keys)  # what the values became, typed by their fields
        if same in seen:
            raise ConfigError(f"point {run_name}", f"has the same config as point {seen[same]} ({point.label(120)}): "
                                                   "drop one of the two values")
        seen[same] = run_name
        plans.append(PointPlan(point, sealed, NEW))
        for check in (lambda: check_submittable(cfg), lambda: _unrelated(sealed, name, known)):
            try:
                check()
            except ConfigError as exc:
                refusals.append(ConfigError(f"point {run_name}", str(exc)))
    plan = Plan(_merged(old, name, base, axes, given_args, [p.point for p in plans]), plans, refusals)
    plan.notes = list(dict.fromkeys(n for p in plans for n in p.sealed.notes))
    if not refusals:
        _existing(plan, force)
        data: dict[str, Optional[str]] = {}
        for p in plan.to_submit:
            key = json.dumps(to_dict(p.cfg.data), default=str)
            if key not in data:
                data[key] = unprepared_data(p.sealed, p.cfg.config_args)
            if data[key]:
                plan.refusals.append(ConfigError(f"point {p.point.run}", f"data: {data[key]}"))
                break
    plan.git = git_state(project_dir)
    return plan


def _unrelated(sealed: Sealed, sweep: str, known: set[str]) -> None:
    paths = sealed.paths
    if (paths.path.exists() or paths.path.is_symlink()) and sealed.cfg.run.name not in known:
        raise ConfigError("run.name", f"{paths.path} exists and is no point of sweep {sweep}: move it aside, or give "
                                      "the sweep another --name")


def _merged(old: Optional[Sweep], name: str, base: Config, axes: list[Axis], given: str, points: list[Point]) -> Sweep:
    """The record with this command's points: earlier ones kept, new ones added after them."""
    sweep = old or Sweep(name=name, created=now_iso())
    have = {p.run for p in sweep.points}
    sweep.points = [*sweep.points, *(p for p in points if p.run not in have)]
    sweep.axes = list(dict.fromkeys([*sweep.axes, *(a.key for a in axes), *(k for p in points for k in p.values)]))
    sweep.config = given or base.config_args
    return sweep


def _existing(plan: Plan, force: bool) -> None:
    """The points whose run exists: queued or running, finished, to resume, or (a changed config
    without `force`) refused. Slurm is asked once for all of them."""
    there = []
    for p in plan.points:
        run = Run(p.sealed.paths)
        if not run.paths.manifest.is_file():
            continue
        try:
            there.append((p, run, manifests.file_key(run.paths.manifest), run.launches()))
        except ManifestError as exc:
            plan.refusals.append(ConfigError(f"point {p.point.run}", str(exc)))
    owns = {id(x): run.events_of(x) for _, run, _, launches in there for x in launches}
    plan.asked = lifecycle.ask_slurm((x, owns[id(x)]) for *_, launches in there for x in launches if not x.local)
    changed = []
    for p, run, key, launches in there:
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
            differs = config_difference(run.paths.config, p.sealed.files[run.paths.config])
            if differs and not force:
                changed.append((p.point.run, differs))
    if changed:
        more = f" (and {len(changed) - 1} more point(s))" if len(changed) > 1 else ""
        plan.refusals.append(ConfigError(f"point {changed[0][0]}", f"exists with {changed[0][1]}{more}: pass --force "
                                                                   "to replace their configs (the old ones are kept "
                                                                   "in history/)"))


# ---------------------------------------------------------------- the arrays


def allocation(sealed: Sealed) -> tuple[str, ...]:
    """The #SBATCH lines of a point's job.sbatch that its array shares (all but its name and logs):
    what it asks of Slurm, exactly as the point's own script says it."""
    lines = [line for line in sealed.files[sealed.paths.job_script].splitlines() if line.startswith("#SBATCH ")]
    mine = ("--job-name=", "--output=", "--error=")
    s = sealed.cfg.slurm
    return (*(line for line in lines if not line[8:].startswith(mine)), f"#output {s.output}", f"#error {s.error}")


def arrays_of(points: list[PointPlan], limit: int) -> list[list[PointPlan]]:
    """The points in arrays: one per allocation they ask (an array asks one), each of at most
    `limit` tasks (the cluster's MaxArraySize: task indices stay below it)."""
    groups: dict[tuple, list[PointPlan]] = {}
    for p in points:
        groups.setdefault(allocation(p.sealed), []).append(p)
    return [g[i:i + limit] for g in groups.values() for i in range(0, len(g), limit)]


def _array_pattern(pattern: str) -> str:
    """A point's log pattern as its task's: %j, the job id, becomes the task's ARRAY_TASK."""
    return pattern.replace("%%", "\0").replace("%j", "%A_%a").replace("\0", "%%")


def render_array(sweep: str, where: Path, points: list[PointPlan], max_parallel: Optional[int]) -> str:
    """The array's batch script: the points' shared allocation lines, the array, and task I
    running the run directory `where/I` links to by its own job.sbatch."""
    first = points[0].sealed
    s = first.cfg.slurm
    own = [line for line in allocation(first) if line.startswith("#SBATCH ")]
    spec = f"0-{len(points) - 1}" + (f"%{max_parallel}" if max_parallel else "")
    root = first.paths.path.parent
    return "\n".join([
        "#!/bin/bash",
        f"# slipway sweep {sweep}: {len(points)} point(s) as one Slurm job array; generated. Task I runs",
        "# POINTS[I] by its own batch script, runs/POINT/job.sbatch, whose allocation lines these are;",
        "# I/ beside this script links to that run, so the task's log is the run's own.",
        f"#SBATCH --job-name={sweep}",
        *own,
        f"#SBATCH --output={sbatch_quote(str(where / '%a' / _array_pattern(s.output)))}",
        f"#SBATCH --error={sbatch_quote(str(where / '%a' / _array_pattern(s.error)))}",
        f"#SBATCH --array={spec}",
        "",
        "set -euo pipefail",
        "POINTS=(" + " ".join(shlex.quote(p.point.run) for p in points) + ")",
        'POINT=${POINTS[$SLURM_ARRAY_TASK_ID]}',
        "# The task's events and manifest entry name it ARRAY_TASK, as squeue and scancel do; its",
        "# SLURM_JOB_ID is its own, which its requeues and exclusions act on.",
        'export SLIPWAY_EVENT_JOB="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"',
        f'exec /bin/bash {shlex.quote(str(root))}/"$POINT"/job.sbatch',
        "",
    ])


def _write_array(sweep: str, home: Path, points: list[PointPlan], max_parallel: Optional[int]) -> Path:
    """arrays/STAMP/: the array's script and, for task I, a link I -> its point's run directory;
    made whole under a temporary name, then renamed into place."""
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
    """Write the record, the points' run directories and their arrays, and sbatch each array;
    the arrays submitted. The caller holds the sweep's lock (`hold`); each point's is held from
    its directory's writing to its job's record, as `slipway submit` holds it."""
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
                script = _write_array(plan.sweep.name, home, chunk, max_parallel)
                job = slurm.sbatch(script, cwd=project_dir)
            except BaseException:
                for p, created, dirs in made:  # nothing of this array ran: no trace of its new runs
                    remove_created_dirs(dirs)
                    if created:
                        shutil.rmtree(p.sealed.paths.path, ignore_errors=True)
                raise
            for i, p in enumerate(chunk):
                record_submission(Run(p.sealed.paths), f"{job}_{i}", p.sealed, git=plan.git)
            array = ArrayJob(job, [p.point.run for p in chunk], str(script.relative_to(home)), now_iso(), max_parallel)
            plan.sweep.arrays.append(array)
            submitted.append(array)
            write_sweep(home / "sweep.json", plan.sweep)
    return submitted


@contextlib.contextmanager
def hold(project_dir: Path, name: str, command: str) -> Iterator[None]:
    """The sweep's lock (runs/.sweeps/.NAME.lock, the runs' own kind): one `slipway sweep` or
    `cancel` of it at a time; a second waits for a short holder, and is refused naming it."""
    where = sweep_dir(project_dir, name)
    made = not where.parent.parent.exists()  # a refused first sweep leaves no runs/ behind
    try:
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(runlock.hold(where, command))
            except ConfigError:
                raise ConfigError("--name", f"sweep {name} is being submitted, run or cancelled by "
                                            f"{runlock.describe(runlock.holder(where))}: try again once it is "
                                            "done") from None
            yield
    finally:
        if made:
            with contextlib.suppress(OSError):
                where.parent.parent.rmdir()  # only if that left it empty
