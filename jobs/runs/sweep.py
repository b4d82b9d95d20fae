"""A sweep: a set of runs from one config and the values that vary (its points), and its record.

Each point is a run (runs/POINT/), with every single-run guarantee. The record, runs/.sweeps/SWEEP/
sweep.json (axes, points with their values, arrays), is one typed model read by the schema engine
and written atomically. Here: the record, the axes and points a command line gives, the points'
names; jobs/runs/arrays.py plans a sweep and queues it as Slurm job arrays.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import re
import types
import typing
from dataclasses import dataclass, field, is_dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar, Optional, get_args, get_origin

from common.errors import ConfigError, bounded_path, pasteable, shown
from common.fs import write_atomic
from common.rundir import RunDir
from common.schema import config_fields, field_of, from_dict, to_dict
from common.yaml import read_text_bounded, read_yaml
from edf.environment import SAFE_NAME
from jobs.config.clusters import ClusterProfile
from jobs.config import Config, check_path_components, config_from
from jobs.config.overrides import MAP_FIELDS, parse_value
from jobs.runs import manifest as manifests
from jobs.runs.manifest import NOT_A_KEY
from jobs.runs.run import Run, runs_root

SWEEPS = ".sweeps"  # runs/.sweeps/SWEEP/: a sweep's record and array scripts (no run directory)
SCHEMA = 1
NAME_ROOM = 60  # a sweep's name leaves its points' values room in a run name's 100 characters


class SweepError(ConfigError):
    """A sweep record that cannot be read: one line naming the file and what to do."""

    def __init__(self, path: Path, why: str, **_: Any):  # whoever's, whichever format: damaged for this slipway
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
            if not SAFE_NAME.fullmatch(p.run):
                raise ConfigError(f"{where}.points[{i}].run", f"{shown(p.run)} is no run name")

    def runs(self, project_dir: Path) -> list[Run]:
        root = runs_root(project_dir)
        return [Run(RunDir(root / p.run, project_dir)) for p in self.points]


def sweep_dir(project_dir: Path, name: str) -> Path:
    return runs_root(project_dir) / SWEEPS / name


def find_sweep(name: str, project_dir: Path) -> Optional[Sweep]:
    """The sweep `name` (None: there is none); SweepError when its record cannot be read."""
    path = sweep_dir(project_dir, name) / "sweep.json"
    if not SAFE_NAME.fullmatch(name) or not (path.exists() or path.is_symlink()):
        return None
    return manifests.read_record(path, Sweep, "sweep", SCHEMA, SweepError)


def write_sweep(path: Path, sweep: Sweep) -> None:
    write_atomic(path, json.dumps(manifests.to_record(sweep), indent=1) + "\n")


class Variants:
    """A sweep's points: the base config (`config_from`'s arguments) with a few fields set, each
    distinct setting read once by the schema and only the changed sections checked again, with the
    rules across sections. A setting that is no plain field, changes more than its field (a preset)
    or is refused is read the whole way, so that what is accepted, and every error, are `config_from`'s."""

    def __init__(self, path: Path, raw: dict, overrides: list[str], sets: dict[str, Any],
                 cluster: Optional[ClusterProfile]) -> None:
        self.args, self.cluster, self.tree = (path, raw, overrides, sets), cluster, {}
        self.base = config_from(path, raw, overrides, sets, cluster=cluster, tree=self.tree)
        self.read: dict[tuple[str, str], Any] = {}
        # A section set (a grid repeats a few settings), or derived again from a point's own values
        # where the base derived it (`unset`), is made once and shared by the points that agree.
        self.sections: dict[tuple, Any] = {}
        self.unset = {section: [name for name in names if self._unset(section, name)]
                      for section, names in Config.DERIVED.items()}
        self.derived: dict[tuple, Any] = {}

    def __call__(self, settings: dict[str, Any], name: str) -> Config:
        """The base with `settings` (dotted key -> value, as an override's value parses), run.name `name`."""
        fields = [self._field(key, value) for key, value in settings.items()]
        if any(f is None for f in fields):
            return config_from(*self.args, {**settings, "run.name": name}, cluster=self.cluster)
        given: dict[str, list] = {}
        for section, name_, value in fields:
            given.setdefault(section, []).append((name_, value))
        cfg = _shallow(self.base)
        try:
            for section, values in given.items():
                setattr(cfg, section, self._section(section, values))
            sources = {section: getattr(cfg, section) for section, names in self.unset.items() if names}
            for section, part in sources.items():
                setattr(cfg, section, _shallow(part))
                getattr(cfg, section).__dict__.update(dict.fromkeys(self.unset[section]))
            cfg.run = _shallow(cfg.run)
            cfg.run.name = name
            cfg.check_between()
        except ConfigError:  # refused: read the whole way, whose error says where the value was written
            return config_from(*self.args, {**settings, "run.name": name}, cluster=self.cluster)
        for section, source in sources.items():
            part = getattr(cfg, section)
            key = (section, id(source), *(repr(getattr(part, n)) for n in self.unset[section]))
            setattr(cfg, section, self.derived.setdefault(key, part))
        return cfg

    def _unset(self, section: str, name: str) -> bool:
        raw = self.tree.get(section)
        if not isinstance(raw, dict) or name not in raw:
            return True
        try:  # `null` read as such; a value the base's read took is no null, whatever policy read it there
            return field_of(type(getattr(self.base, section)), name, raw[name], section) is None
        except ConfigError:
            return False

    def _section(self, section: str, values: list[tuple[str, Any]]) -> Any:
        """The base's `section` with `values` (field, value read) set, checked (ConfigError if refused)."""
        key = (section, *((name, repr(value)) for name, value in values))
        part = self.sections.get(key)
        if part is None:
            part = _shallow(getattr(self.base, section))
            for name, value in values:
                setattr(part, name, value)
            if hasattr(part, "check"):
                part.check(section)
            self.sections[key] = part
        return part

    def typed(self, cfg: Config, key: str, value: Any) -> Any:
        """The value setting `key` to `value` gave `cfg`, a point of these (`typed` where it was read whole)."""
        found = self.read.get((key, repr(value)))
        return found[2] if found else typed(cfg, key)

    def _field(self, key: str, value: Any) -> Optional[tuple[str, str, Any]]:
        """(section, field, its value read) for setting `key`, or None: no plain field of a section."""
        marker = (key, repr(value))
        if marker not in self.read:
            self.read[marker] = None
            section, _, name = key.partition(".")
            cls = type(getattr(self.base, section)) if section in config_fields(Config) else None
            raw = self.tree.get(section, {})
            if cls and name in config_fields(cls) and not is_dataclass(getattr(getattr(self.base, section), name)) \
                    and isinstance(raw, dict):
                try:
                    if hasattr(cls, "__post_init__"):  # which may fill other fields from this one (a preset)
                        part = from_dict(cls, {**raw, name: value}, section)
                        read = getattr(part, name)
                        plain = _shallow(getattr(self.base, section))
                        setattr(plain, name, read)
                        if plain != part:
                            return None
                    else:  # the one field (its section is checked where it is set)
                        read = field_of(cls, name, value, section)
                    check_path_components(to_dict(read), key)
                except ConfigError:
                    return None  # read the whole way, which says what is wrong and where
                self.read[marker] = (section, name, read)
        return self.read[marker]


def _shallow(obj: Any) -> Any:
    """A copy of dataclass `obj` sharing its values: copy.copy's result, at a fifth of its cost."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    return new


@dataclass(frozen=True)
class Axis:
    key: str
    values: tuple  # each as an override's value parses (what apply_override sets)


_hints = lru_cache(maxsize=None)(typing.get_type_hints)


def _bare(tp: Any) -> Any:
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
    """The axes among `overrides` (KEY=[V1, ...] on a non-list field; a list field's a list of lists) and the rest."""
    axes, plain = [], []
    for item in overrides:
        key, sep, text = item.partition("=")
        key, stripped = key.strip(), text.strip()
        if not (sep and stripped.startswith("[") and stripped.endswith("]")):
            if "," in stripped and field_type(key) in (int, float, bool):  # Hydra's multirun form, a=1,2
                axis = f"{key}=[{', '.join(v.strip() for v in stripped.split(','))}]"
                raise ConfigError(key, f"{shown(stripped)} is one value, not an axis: give {pasteable(axis)}")
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
        dupes = sorted(t for t, n in collections.Counter(map(value_text, values)).items() if n > 1)
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
                if isinstance(v, dict) and field_type(key) is not None and get_origin(field_type(key)) is not dict:
                    walk(v, key + ".")
                else:
                    flat[key] = v
        walk(item, "")
        if "run.name" in flat:
            raise ConfigError(f"--points[{i}].run.name", "a sweep names its points itself: name the sweep with --name")
        if flat in out:
            raise ConfigError(f"--points[{i}]", f"is --points[{out.index(flat)}] again: give each point once")
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
    return list(_short_keys(tuple(keys)))


@lru_cache(maxsize=64)  # every point of a sweep asks for the same keys
def _short_keys(keys: tuple[str, ...]) -> tuple[str, ...]:
    out = []
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            tail = parts[-n:]
            if n == len(parts) or not any(k != key and k.split(".")[-n:] == tail for k in keys):
                out.append("_".join(tail))
                break
    return tuple(out)


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def point_names(sweep: str, settings: list[dict[str, Any]]) -> list[str]:
    """Each point's run name, stable (its own values alone): the sweep's, then each value after its
    short key (`tiny-lr0.001-micro_batch_size8`). A name with a value no run name holds as it is (a
    path, a list), past 100 characters, or two points would share, is cut and ends in a hash."""
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
    shared = {n for n, count in collections.Counter(names).items() if count > 1}
    return [name(s, True) if n in shared else n for s, n in zip(settings, names)]
