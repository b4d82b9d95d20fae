"""The container environment a run uses (`run_environment`; the image is pinned by image.py), and
the paths its trainer reads and writes, resolved once at submission: relative ones made absolute in
the frozen config, each mounted at the same path inside the container unless a user mount already
shows it there; a user mount that would cover one with something else is refused with the fix.
Every way into the container turns the environment into srun flags through `edf.srun_flags`.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from common.errors import ConfigError, bounded_path
from common.rundir import CodeSnapshot, RunDir
from edf import Environment, Mount, expand_host, resolve_base
from jobs.config import Config
from jobs.runs.image import ImagePin, base_field


@dataclass(frozen=True)
class Need:
    """A host path the job uses, to be seen at the same path inside the container."""

    path: Path  # absolute, variables expanded
    what: str  # for messages: "the run directory", "data.cache_dir (the token cache)"
    writable: bool
    create: bool  # a directory slipway creates at submission if missing


def _expand(value: str, field: str) -> str:
    return os.path.expanduser(expand_host(value, field))


def _absolute(value: str, field: str, base: Path) -> Path:
    return base / _expand(value, field)  # an absolute path replaces `base`


def _is_path(value: Optional[str], field: str) -> bool:
    """A dataset or tokenizer given as a path rather than a hub name (or builtin)."""
    if not value or value == "builtin":
        return False
    if value.startswith(("/", "./", "../", "~", "$")):
        return True
    try:
        return Path(_expand(value, field)).exists()
    except ConfigError:
        return False


def _glob_root(path: Path) -> Path:
    """The directory above the first wildcard of a glob (what a mount must show)."""
    return Path(*itertools.takewhile(lambda part: not any(c in part for c in "*?["), path.parts))


def default_token_cache(paths: RunDir) -> Path:
    """The token cache every run of a project shares: `.cache/tokens` beside `runs/`."""
    return paths.path.parent.parent / ".cache" / "tokens"


def default_hf_home(paths: RunDir) -> Path:
    return paths.project / ".cache" / "huggingface"


def hf_home(cfg: Config, paths: RunDir) -> str:
    """Where hub downloads land for a launch from this shell, by the batch script's rule
    (jobs/slurm/script.py): launch.hf_home, else $HF_HOME, else the project's cache."""
    if cfg.launch.hf_home:
        return expand_host(cfg.launch.hf_home, "launch.hf_home")
    return os.environ.get("HF_HOME") or str(default_hf_home(paths))


def resolve_paths(cfg: Config, paths: RunDir) -> Config:
    """`cfg` with every path the trainer reads made absolute (relative to the project directory)
    and the token cache named: the frozen config means the same on every node, in any workdir."""
    # A copy of the sections it changes (the rest is shared, read only): a sweep resolves a thousand.
    cfg = copy.copy(cfg)
    cfg.data, cfg.model, cfg.train = copy.copy(cfg.data), copy.copy(cfg.model), copy.copy(cfg.train)
    base = paths.project
    d = cfg.data
    d.cache_dir = str(_absolute(d.cache_dir, "data.cache_dir", base)) if d.cache_dir else \
        str(default_token_cache(paths))
    for field_name in ("dataset", "tokenizer", "validation_split"):
        value = getattr(d, field_name)
        if _is_path(value, f"data.{field_name}") and not value.startswith("$"):
            setattr(d, field_name, str(_absolute(value, f"data.{field_name}", base)))
    if cfg.model.init_from_hf and not cfg.model.init_from_hf.startswith("$"):
        cfg.model.init_from_hf = str(_absolute(cfg.model.init_from_hf, "model.init_from_hf", base))
    if cfg.train.script and not cfg.train.script.startswith("$"):
        cfg.train.script = str(_absolute(cfg.train.script, "train.script", base))
    return cfg


def needed_paths(cfg: Config, paths: RunDir) -> list[Need]:
    """Every host path the job reads or writes by name (`cfg` already through `resolve_paths`)."""
    needs = [Need(paths.path, "the run directory", True, False)]
    needs.append(Need(_absolute(cfg.data.cache_dir or str(default_token_cache(paths)), "data.cache_dir",
                                paths.project), "data.cache_dir (the token cache)", True, True))
    hf = _absolute(cfg.launch.hf_home, "launch.hf_home", paths.project) if cfg.launch.hf_home else \
        default_hf_home(paths)
    needs.append(Need(hf, "launch.hf_home (the Hugging Face cache)", True, True))
    for field_name in ("dataset", "tokenizer", "validation_split"):
        value = getattr(cfg.data, field_name)
        if _is_path(value, f"data.{field_name}"):
            path = _glob_root(_absolute(value, f"data.{field_name}", paths.project))
            needs.append(Need(path, f"data.{field_name}", False, False))
    if cfg.model.init_from_hf:
        needs.append(Need(_absolute(cfg.model.init_from_hf, "model.init_from_hf", paths.project),
                          "model.init_from_hf", False, False))
    if cfg.train.script:
        script = _absolute(cfg.train.script, "train.script", paths.project)
        needs.append(Need(script.parent, "train.script's directory", False, False))
    # One mount for a path inside another mounted anyway (a writable one wins); the rest in order.
    kept: list[Need] = []
    for need in sorted(needs, key=lambda n: (len(n.path.parts), not n.writable)):
        outer = next((k for k in kept if need.path == k.path or k.path in need.path.parents), None)
        if outer is None or (need.writable and not outer.writable):
            kept.append(need)
    return [need for need in needs if need in kept]


def _user_mounts(env: Environment) -> list[tuple[int, Mount, Path, Path]]:
    """(index, mount, source, destination) with host variables expanded."""
    return [(i, m, Path(_expand(m.src, f"container.mounts[{i}]")), Path(_expand(m.dst, f"container.mounts[{i}]")))
            for i, m in enumerate(env.mounts)]


def visibility_mounts(cfg: Config, paths: RunDir) -> list[Mount]:
    """The mounts showing each needed path at its own path in the container; a user mount hiding one: an error."""
    return [mount for _, mount in _visibility(cfg, paths)]


def _visibility(cfg: Config, paths: RunDir) -> list[tuple[Need, Mount]]:
    env = cfg.container
    if not env.in_container:
        return []
    user = _user_mounts(env)
    if env.workdir is not None:
        # The trainer's paths are absolute: the workdir matters only by hand; is it a path at all?
        _expand(env.workdir, "container.workdir")
    added: list[tuple[Need, Mount]] = []
    for need in needed_paths(cfg, paths):
        shown = False
        for i, mount, src, dst in user:
            if dst.is_relative_to(need.path) and not (dst == need.path and src == need.path):
                raise ConfigError(f"container.mounts[{i}]", f"{mount.spec()!r} is mounted at {dst}, which is "
                                  f"{need.what} ({need.path}) or inside it, so the job would not see it there: "
                                  "mount it elsewhere or drop it")
            if need.path.is_relative_to(dst):  # mounts apply in order: the last one over the path decides
                shown = src / need.path.relative_to(dst) == need.path and not (need.writable and "ro" in mount.flags)
        if not shown:
            added.append((need, Mount(str(need.path), str(need.path), () if need.writable else ("ro",))))
    return added


def create_needed_dirs(cfg: Config, paths: RunDir) -> list[Path]:
    """Make the cache directories the job fills (mount sources must exist); the directories it made."""
    if not cfg.container.in_container:
        return []
    created: list[Path] = []
    try:
        for need in needed_paths(cfg, paths):
            field = need.what.split(" ")[0]
            try:
                if need.create:
                    missing = [p for p in (need.path, *need.path.parents) if not p.exists()]
                    need.path.mkdir(parents=True, exist_ok=True)
                    created += missing
                elif not need.path.exists() and need.what != "the run directory":
                    raise ConfigError(field, f"{bounded_path(need.path)} does not exist on this node")
            except OSError as exc:  # not writable, or a name longer than the filesystem takes
                raise ConfigError(field, f"cannot create {bounded_path(need.path)} ({exc.strerror}): point it at "
                                         "a writable shared directory with a shorter path") from None
    except BaseException:  # a refused submission leaves none of the directories it made
        remove_created_dirs(created)
        raise
    return created


def remove_created_dirs(created: list[Path]) -> None:
    """Undo `create_needed_dirs` where the directories stayed empty (a submission that failed)."""
    for path in sorted(created, key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            path.rmdir()


def run_environment(cfg: Config, paths: RunDir, pin: ImagePin, code: Optional[CodeSnapshot] = None) -> Environment:
    """The run's container environment: the config's with the pinned image, visibility mounts and `_with_code`."""
    env = cfg.container
    if not env.in_container:
        return env
    out = _with_code(replace(env, image=pin.image or env.image, mounts=[*env.mounts, *visibility_mounts(cfg, paths)]),
                     code)
    out.check("container")
    return out


def _with_code(env: Environment, code: Optional[CodeSnapshot]) -> Environment:
    """`env` with the code snapshot mounted read-only at its own path, in front of the image's baked
    trainer. A PYTHONPATH of the config's or of env_from_host stays behind it, the image's is
    replaced; a name of env_from_host among the snapshot's variables is passed inside their value."""
    if code is None:
        return env
    values, from_host = dict(env.env), list(env.env_from_host)
    own = env.env.get("PYTHONPATH") or ("${PYTHONPATH}" if "PYTHONPATH" in from_host else None)
    values.update(code.environment(own))
    return replace(env, mounts=[*env.mounts, Mount(code.dir, code.dir, ("ro",))], env=values,
                   env_from_host=[name for name in from_host if name not in values])


def shell_environment(cfg: Config, paths: RunDir, pin: ImagePin,
                      code: Optional[CodeSnapshot] = None) -> tuple[Environment, list[str]]:
    """`slipway shell`'s container environment and notes: the run's, with the checkout's code as
    `code`, less the paths the job would create that do not exist yet (a shell writes nothing into a
    run: a submission makes the run directory, it or `prepare` the caches), each mount source checked
    here (a missing one: one line before srun, not a failure after the image is unpacked)."""
    env = cfg.container
    if not env.in_container:
        return env, []
    kept: list[Mount] = []
    left_out: list[Need] = []
    for need, mount in _visibility(cfg, paths):
        if need.path.exists():
            kept.append(mount)
        elif need.writable:
            left_out.append(need)
        else:
            raise ConfigError(need.what.split(" ")[0].removesuffix("'s"),
                              f"{bounded_path(need.path)} does not exist on this node, "
                                                       "so the shell cannot mount it: fix the path or create it")
    for i, _, src, _ in _user_mounts(env):
        if not src.exists():
            raise ConfigError(f"container.mounts[{i}]", f"mount source {bounded_path(src)} does not exist on this "
                                                        "node: create it, or drop the mount")
    if env.base_environment:
        merged = resolve_base(replace(env, mounts=[]))
        for mount in merged.mounts:
            src = Path(_expand(mount.src, "container.base_environment"))
            if not src.exists():
                field = base_field(env, lambda one, m=mount: m in one.mounts)
                raise ConfigError(field, f"the base environment mounts {bounded_path(src)}, which does not exist "
                                         "on this node: create it, or fix that EDF's mounts")
    notes = [f"not mounted in the shell: {need.what} {need.path} does not exist yet (a submission creates "
             "it; the shell creates nothing)" for need in left_out]
    out = _with_code(replace(env, image=pin.image or env.image, mounts=[*env.mounts, *kept]), code)
    out.check("container")
    return out, notes
