"""What must hold before a launch writes a run: the variables the job takes from this host, the
files the config names, and whether an existing run's config is the one a launch would write.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from common.errors import ConfigError
from common.secrets import TEXT, refusal
from common.yaml import read_text_bounded
from edf import expand_host
from jobs import slurm
from jobs.config import Config, config_changes, dump_config, interpreter, load_config


def check_env_from_host(cfg: Config) -> None:
    """At submission: every `container.env_from_host` variable is set here and reaches the job, which
    takes them from what sbatch exports (ALL by default; its sruns keep it): an --export without one
    (slurm.extra, or $SBATCH_EXPORT, which outranks #SBATCH lines) would start the job without it."""
    names = cfg.container.env_from_host
    cfg.container.require_host_env(dict(os.environ))
    exports = [(f"slurm.extra[{i}]", opt.split("=", 1)[1]) for i, opt in enumerate(cfg.slurm.extra)
               if opt.startswith("--export=")]
    if "SBATCH_EXPORT" in os.environ:
        exports.append(("SBATCH_EXPORT", os.environ["SBATCH_EXPORT"]))
    for where, value in exports:
        listed = [v.split("=", 1)[0] for v in value.split(",")]
        for item, name in zip(value.split(","), listed):  # slurm.extra's were refused as the config was read
            found = refusal(item.split("=", 1)[1], name=name, policy=TEXT) if "=" in item else None
            if found is not None:
                raise ConfigError(where, found.message())
        dropped = [n for n in names if "ALL" not in listed and n not in listed]
        if dropped:  # the names alone are shown: an --export may hold NAME=value pairs
            raise ConfigError(where, f"an --export that names {', '.join(listed)} does not pass "
                                     f"{', '.join(dropped)} (container.env_from_host) to the job: use --export=ALL, "
                                     f"or add {dropped[0]} to it")


def check_submittable(cfg: Config) -> None:
    """What must hold on disk at submission, beyond the image and the paths `seal` checks."""
    c = cfg.container
    check_env_from_host(cfg)
    slurm.check_sbatch_environment()
    if c.in_container:
        for i, mount in enumerate(c.mounts):
            src = expand_host(mount.src, f"container.mounts[{i}]")
            if not Path(src).exists():
                raise ConfigError(f"container.mounts[{i}]", f"mount source {src} does not exist on this node")
    if cfg.train.script and not Path(cfg.train.script).is_file():
        raise ConfigError("train.script", f"training script {cfg.train.script} does not exist")


def config_difference(path: Path, new: str) -> Optional[str]:
    """How the run's config.yaml differs from `new` (the resolved config a launch would write),
    None if it does not. The old file is read through today's schema and dumped again: a key a
    later slipway added, at its default, is no difference."""
    try:  # a FIFO or a device in its place raises NotRegularFile (one line), never hangs
        old = read_text_bounded(path, "config.yaml")
    except FileNotFoundError:
        return "no config.yaml"
    if old == new:
        return None
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        return f"a config this slipway no longer reads ({exc})"
    resolved = dump_config(cfg)
    if resolved != new and cfg.container.runtime == "none":  # its interpreter recorded by an alias (`python3`)
        cfg.launch.python = interpreter(cfg.launch.python)
        resolved = dump_config(cfg)
    return None if resolved == new else f"a different config ({config_changes(resolved, new)})"
