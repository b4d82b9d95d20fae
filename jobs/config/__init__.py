"""The one config tree: `configs/NAME.yaml` plus command-line overrides, read once.

`Config` is the trainer's `TrainerConfig` (run, model, parallel, data, train, checkpoint,
logging: trainer/config.py, no torch) extended with the host's sections (slurm, container,
launch, image, code), so the image reads the frozen `config.yaml` into the very same
dataclasses. Nothing downstream reads raw dicts.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

import yaml

from common.baseline import accepting
from common.environ import project_dir
from common.errors import ConfigError, bounded, shown
from common.schema import from_dict, require, to_dict
from common.yaml import at_line, read_text_bounded, read_yaml
from containers.record import ImageNeeds, ImageSection
from edf.environment import NOT_CONFIG, SAFE_NAME, Environment
from jobs.config.clusters import ClusterProfile, merged
from jobs.config.overrides import BOOL_FLAGS as BOOL_FLAGS, CLUSTER_FLAGS, NAMED_FLAGS, apply_override, parse_value
from jobs.config.sections import NODE_PRESETS, LaunchSection, SlurmSection
from trainer.config import MODEL_DIMENSIONS, MODEL_PRESETS, TrainerConfig, check_trainer_sections

# Slurm job names, file names and EDF names all come from run names (SAFE_NAME).
SAFE_NAME_RULE = "use 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit"


@dataclass
class CodeSection:
    """The code a run runs (jobs/runs/code.py).

    Each launch copies the `trainer` package (and a train.script with its folder)
    into runs/.code/HASH/, one copy per distinct content, and runs it in front of
    the image's baked code: a code change needs no image rebuild, and editing the
    checkout after a submission changes nothing for that run.
    """

    # false: run the code baked into the image (a fully sealed production image).
    snapshot: bool = True


@dataclass
class Config(TrainerConfig):
    """The whole tree: the trainer's sections (TrainerConfig) and, below, the host's own."""

    slurm: SlurmSection = field(default_factory=SlurmSection)
    container: Environment = field(default_factory=Environment)
    launch: LaunchSection = field(default_factory=LaunchSection)
    image: ImageSection = field(default_factory=ImageSection)
    code: CodeSection = field(default_factory=CodeSection)
    # The file it was read from (messages say `make image CONFIG=NAME`); not part of the config.
    source: Optional[Path] = field(default=None, compare=False, repr=False, metadata=NOT_CONFIG)
    # The command line's CONFIG, overrides and config flags, shell-quoted (set by the CLI), so a
    # suggested `slipway ...` reads the same config the user's own command did.
    given_args: Optional[str] = field(default=None, compare=False, repr=False, metadata=NOT_CONFIG)
    # The cluster profile merged in (jobs/config/clusters.py), None without one: the manifest records it
    # and the cluster's remembered bad nodes go by its name.
    cluster: Optional[ClusterProfile] = field(default=None, compare=False, repr=False, metadata=NOT_CONFIG)

    @property
    def config_name(self) -> str:
        """What `make ... CONFIG=` takes for this config."""
        if self.source is None:
            return self.run.name
        return self.source.stem if self.source.parent == Path("configs") else str(self.source)

    @property
    def config_args(self) -> str:
        """What a suggested `slipway COMMAND ...` repeats: the user's own config arguments."""
        return self.given_args or shlex.quote(self.config_name)

    def config_args_setting(self, settings: dict[str, Any]) -> str:
        """`config_args` with `settings` (config key -> value) in place of what the user gave for
        those keys, each by its named flag where it has one: what a suggestion that changes them says."""
        flags = {key: flag for flag, key, _, _ in NAMED_FLAGS + CLUSTER_FLAGS}
        words, kept, skip = shlex.split(self.config_args), [], False
        for word in words:
            if skip:
                skip = False
            elif word in {flags.get(key) for key in settings}:
                skip = True  # and its value
            elif word.split("=", 1)[0] not in settings:
                kept.append(word)
        for key, value in settings.items():
            kept += [flags[key], str(value)] if key in flags and value is not None else [
                f"{key}={'null' if value is None else value}"]
        return shlex.join(kept)

    # The fields the rules across sections fill where the config leaves them unset (`check_between`):
    # a sweep's point built from its base derives its own (jobs/runs/sweep.py's Variants).
    DERIVED: ClassVar[dict[str, tuple[str, ...]]] = {"launch": ("python", "procs_per_node"),
                                                     "slurm": ("cpus_per_task",)}

    def check(self, where: str) -> None:
        check_path_components(to_dict(self), "")
        self.check_between()

    def check_between(self) -> None:
        """The rules across sections (each section checks its own fields as it is read)."""
        require(bool(SAFE_NAME.fullmatch(self.run.name)), "run.name",
                lambda: f"{shown(self.run.name)} is not a safe run name: {SAFE_NAME_RULE}")
        if self.launch.python is None:
            self.launch.python = interpreter(sys.executable) if self.container.runtime == "none" else "python3"
        if self.launch.procs_per_node is None:
            self.launch.procs_per_node = self.slurm.gpus_per_node or 1
        self._check_preset()
        p, world = self.parallel, self.world_size
        if not self.launch.command:
            require(p.world_size == world, "parallel",
                    f"dp({p.dp}) x tp({p.tp}) x pp({p.pp}) = {p.world_size} != nodes({self.slurm.nodes}) x "
                    f"procs_per_node({self.launch.procs_per_node}) = {world}: change slurm.nodes, "
                    "slurm.gpus_per_node (or launch.procs_per_node) or parallel.dp/tp/pp so they match")
            check_trainer_sections(self)
        if self.slurm.gpus_per_node:
            require(self.launch.procs_per_node <= self.slurm.gpus_per_node, "launch.procs_per_node",
                    f"{self.launch.procs_per_node} processes per node but only slurm.gpus_per_node("
                    f"{self.slurm.gpus_per_node}) GPUs: lower procs_per_node or raise gpus_per_node")

    def _check_preset(self) -> None:
        s, launch = self.slurm, self.launch
        preset = NODE_PRESETS.get(launch.preset)
        tasks = 1 if self.launcher == "torchrun" else launch.procs_per_node
        if preset is None:
            if s.cpus_per_task is None:
                s.cpus_per_task = 8
            return
        require(s.gpus_per_node == preset.gpus and launch.procs_per_node == preset.gpus, "launch.preset",
                f"{launch.preset} is a {preset.what}: it needs slurm.gpus_per_node and launch.procs_per_node "
                f"{preset.gpus} (one rank per GPU), got {s.gpus_per_node} and {launch.procs_per_node}")
        cores = preset.cores // tasks
        if s.cpus_per_task is None:
            s.cpus_per_task = cores
        require(s.cpus_per_task == cores, "slurm.cpus_per_task",
                f"launch.preset {launch.preset} gives each rank the {preset.cores // preset.gpus} cores next to "
                f"its GPU, so with launcher {self.launcher} ({tasks} task(s) per node) cpus_per_task must be "
                f"{cores}, got {s.cpus_per_task}: drop slurm.cpus_per_task or set it to {cores}")

    @property
    def world_size(self) -> int:
        return self.slurm.nodes * self.launch.procs_per_node

    @property
    def launcher(self) -> str:
        """What starts the ranks, torchrun or srun: launch.launcher, `auto` decided (`launch_choice`)."""
        return self.launch_choice[0]

    @property
    def launch_choice(self) -> tuple[str, str]:
        """(the launcher, why it is the one): launch.launcher's `auto` takes srun wherever torchrun's
        agents would only cost, as slipway asks them for no elastic restarts (--max-restarts=0)."""
        launch = self.launch
        if launch.launcher != "auto":
            return launch.launcher, f"launch.launcher {launch.launcher}"
        if launch.command and launch.command[0] != launch.python:
            return "srun", "launch.launcher auto: launch.command is no Python program torchrun could start"
        if launch.command or self.train.script:
            what = "launch.command" if launch.command else "train.script"
            return "torchrun", (f"launch.launcher auto: {what} is your program, which may read torchrun's own "
                                "variables; launch.launcher srun starts it without agents")
        return "srun", ("launch.launcher auto: slipway's trainer needs no torchrun agent (no elastic restarts: "
                        "one process and a rendezvous less per node); one srun task per rank")

    @property
    def binds_numa(self) -> bool:
        """Each rank bound to its GPU's NUMA node by `torchrun --numa-binding` (a node preset with
        the torchrun launcher), which runs every worker under numactl."""
        return self.launch.preset in NODE_PRESETS and self.launcher == "torchrun"

    @property
    def image_needs(self) -> ImageNeeds:
        return ImageNeeds(float8=self.train.float8, numactl=self.binds_numa)


# Linux filesystems take names of at most 255 bytes (NAME_MAX): a longer component in a path
# fails at the first stat, wherever that is; here it is refused naming its field.
NAME_MAX = 255


def check_path_components(value: Any, where: str) -> None:
    """Every string of the tree that reads as a path (a '/', no whitespace): components of at most NAME_MAX bytes."""
    if isinstance(value, dict):
        for key, item in value.items():
            check_path_components(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_path_components(item, f"{where}[{i}]")
    elif isinstance(value, str) and "/" in value and not any(c.isspace() for c in value):
        longest = max(value.split("/"), key=lambda part: len(part.encode(errors="replace")))
        size = len(longest.encode(errors="replace"))
        require(size <= NAME_MAX, where, f"the path component {shown(longest)} is {size} bytes; file systems "
                                          f"take names of at most {NAME_MAX}: shorten it")


def load_config(path: str | Path, overrides: list[str] | None = None, sets: dict[str, Any] | None = None,
                cluster: Optional[ClusterProfile] = None) -> Config:
    """Read `configs/NAME.yaml` (or a path) into a Config (`config_from`); `sets`: the CLI's named
    flags as dotted key -> typed value."""
    path, raw = read_config(path)
    return config_from(path, raw, overrides, sets, cluster=cluster)


def read_config(path: str | Path) -> tuple[Path, dict]:
    """The file `path` names and its raw tree, read once (a sweep builds each point from it: `config_from`)."""
    path = resolve_config_path(path)
    try:
        text = read_text_bounded(path, "CONFIG")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("CONFIG", f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    raw = read_yaml(text, str(path))
    if raw is None:
        raise ConfigError("CONFIG", f"{path} is empty: a config needs its sections (run:, slurm:, model:, ...); "
                                    "start from a copy of configs/tiny_cpu.yaml")
    if not isinstance(raw, dict):
        raise ConfigError("CONFIG", f"{path} must hold a mapping of sections such as run:, slurm:, model:")
    return path, raw


def config_from(path: Path, raw: dict, overrides: list[str] | None = None, sets: dict[str, Any] | None = None,
                settings: dict[str, Any] | None = None, cluster: Optional[ClusterProfile] = None,
                tree: Optional[dict] = None) -> Config:
    """The config of file `path` from its raw tree (left as it is) with the `cluster` profile, the
    overrides, `sets`, then `settings` (as overrides parse) over it, validated: the config < the profile
    < the command line (jobs/config/clusters.py says why). `tree`: filled with the raw tree as read."""
    raw = merged(raw, cluster.settings) if cluster is not None else _copied(raw)
    given = {*(sets or {}), *(settings or {})}
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(item, "an override must look like section.key=value, e.g. train.steps=100")
        apply_override(raw, key.strip(), parse_value(value, key.strip()))
        given.add(key.strip())
    for key, value in [*(sets or {}).items(), *(settings or {}).items()]:
        apply_override(raw, key, value)
    _refuse_ineffective_size(raw, path, overrides or [], sets or {})
    run = raw.setdefault("run", {}) if isinstance(raw.get("run", {}), dict) else raw["run"]
    if isinstance(run, dict) and not run.get("name"):
        run["name"] = path.stem
    if tree is not None:
        tree.update(raw)
    try:
        with accepting(path):  # what the file's own pragma lines and baseline accept (docs/secrets.md)
            cfg = from_dict(Config, raw)
    except ConfigError as exc:  # a value the profile or the file gave: say where it came from
        if exc.field in given:
            raise
        if cluster is None or not cluster.sets(exc.field):
            raise at_line(exc, path, exc.field) from None
        raise ConfigError(exc.field, f"{str(exc)[len(exc.field) + 2:]} (set by {cluster.where})") from None
    cfg.source, cfg.cluster = path, cluster
    return cfg


def _refuse_ineffective_size(raw: dict, path: Path, overrides: list[str], sets: dict[str, Any]) -> None:
    """A model preset asked for on the command line where every dimension is set already would
    change nothing: refused, not ignored (a run of another size than the user asked for)."""
    given = sets.get("model.size") or next((o.partition("=")[2] for o in overrides
                                            if o.partition("=")[0].strip() == "model.size"), None)
    model = raw.get("model")
    if given is None or not isinstance(model, dict) or str(given) not in MODEL_PRESETS:
        return
    if all(model.get(d) is not None for d in MODEL_DIMENSIONS):
        said = f"--model-size {given}" if "model.size" in sets else f"model.size={given}"
        raise ConfigError("model.size", f"{said} cannot take effect: {path} (with the command line) sets every "
                                        f"dimension of the model ({', '.join(MODEL_DIMENSIONS)}), which a preset only "
                                        "fills where unset; use a config that leaves them unset, or set the "
                                        "dimensions themselves (--hidden-size, --num-layers, ...)")


def _copied(node: Any) -> Any:
    """The raw tree's mappings and lists copied, for overrides to set into (the values are
    strings and numbers, which none changes): deepcopy's work without its bookkeeping."""
    if isinstance(node, dict):
        return {key: _copied(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_copied(value) for value in node]
    return node


def resolve_config_path(name: str | Path) -> Path:
    """`tiny_cpu`, `tiny_cpu.yaml`, `configs/tiny_cpu.yaml` or any path to a YAML file."""
    text = str(name)
    candidates = [Path(text)]
    if "/" not in text:
        candidates.append(Path("configs") / text)
    if not text.endswith((".yaml", ".yml")):
        candidates += [Path("configs") / f"{text}.yaml", Path(f"{text}.yaml")]
    for candidate in candidates:
        try:
            if candidate.is_file():
                return candidate
        except OSError as exc:  # e.g. a name longer than the filesystem allows
            raise ConfigError("CONFIG", f"{bounded(text, 60)!r} is not a usable path "
                                        f"({exc.strerror}): give a config name such as tiny_cpu") from None
    known = sorted(p.stem for p in Path("configs").glob("*.yaml")) if Path("configs").is_dir() else []
    hint = f"; known configs: {', '.join(known)}" if known else ""
    shown = ", ".join(dict.fromkeys(map(str, candidates)))
    cwd, root = Path.cwd(), project_dir()
    where = (f"in the working directory {cwd}, which is also the project root (runs/ goes there)" if root == cwd
             else f"in the working directory {cwd}; the project root, where runs/ goes, is {root} (SLIPWAY_PROJECT)")
    # The checkout this slipway runs from (an editable install, as `make setup` makes) may hold it.
    home = Path(__file__).resolve().parents[2]  # jobs/config/__init__.py in the checkout
    there = next((c for c in candidates if not c.is_absolute() and (home / c).is_file()), None)
    fix = (f"; the checkout slipway runs from has {there}: `cd {shlex.quote(str(home))}` first" if there and home != cwd
           else "; give a path, or run slipway from the directory that holds configs/")
    raise ConfigError("CONFIG", f"no config file {text!r} (looked for {shown} {where}){hint}{fix}")


@functools.lru_cache(maxsize=256)
def interpreter(path: str) -> str:
    """The interpreter at `path` by what it is, not the alias that ran it: its directory resolved (a
    project reached through a symlink, `/home` for `/users`, is one path) and the name there with
    its version that is the same file (`python3.11` for a venv's `python` and `python3`). Not the
    file it links to: a venv's python links to the base interpreter, which would leave the venv."""
    if not os.path.isabs(path):  # a name the PATH finds where the job runs
        return path
    where = os.path.realpath(os.path.dirname(path))
    same = os.path.realpath(os.path.join(where, os.path.basename(path)))
    try:
        versions = sorted(n for n in os.listdir(where) if re.fullmatch(r"python\d+\.\d+", n))
    except OSError:  # not a directory here (a compute node's path): as given
        return os.path.join(where, os.path.basename(path))
    named = [n for n in versions if os.path.realpath(os.path.join(where, n)) == same]
    return os.path.join(where, named[0] if named else os.path.basename(path))


# libyaml's emitter where PyYAML has it: the same text, a third of the time (a sweep writes a thousand).
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def dump_config(cfg: Config) -> str:
    """The resolved config exactly as the job reads it."""
    return yaml.dump(to_dict(cfg), Dumper=_DUMPER, sort_keys=False, default_flow_style=False, width=1000)


def config_changes(old: str, new: str, limit: int = 6) -> str:
    """What differs between two dumped configs, key by key (`train.steps 200 -> 400`), the first
    `limit` of them: what a refused change of a run's config says."""
    def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(tree, dict):
            return {prefix: tree}
        return {k: v for key, value in tree.items() for k, v in flat(value, f"{prefix}{key}.").items()} or {prefix: {}}

    try:
        before, after = flat(yaml.safe_load(old)), flat(yaml.safe_load(new))
    except yaml.YAMLError:
        return "a different config"
    changed = [f"{key.rstrip('.')} {shown(before.get(key, '(unset)'))} -> {shown(after.get(key, '(unset)'))}"
               for key in sorted(before.keys() | after.keys()) if before.get(key) != after.get(key)]
    more = f" and {len(changed) - limit} more" if len(changed) > limit else ""
    return ", ".join(changed[:limit]) + more if changed else "a different config"
