"""Values slipway takes from its environment, checked like config values: the environment is input.
Slurm's variables land in paths, command lines and arithmetic, so a value of the wrong shape (`../x`,
`1;rm -rf ~`, an empty node name) is refused where it is read, in one line naming the variable,
whatever set it (a shell left from another allocation, a user's export, a wrapper script).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Mapping, Optional

from common.errors import ConfigError, bounded_path, shown

JOB_ID = re.compile(r"[0-9]{1,12}")  # SLURM_JOB_ID: an array task's own id is one too
WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # a name that is safe as a file name's part
COUNT = re.compile(r"[0-9]{1,7}")


def _text(name: str, environ: Optional[Mapping[str, str]]) -> Optional[str]:
    """A variable's value; None where it is unset or empty (`VAR=` in a shell unsets, as in a config)."""
    return (os.environ if environ is None else environ).get(name) or None


def _value(name: str, pattern: re.Pattern, what: str, environ: Optional[Mapping[str, str]]) -> Optional[str]:
    value = _text(name, environ)
    if value is not None and not pattern.fullmatch(value):
        raise ConfigError(f"${name}", f"{shown(value)} is not {what}, as Slurm sets it: unset it, or run "
                                      "slipway from a shell of the job or allocation that set it")
    return value


def project_dir(environ: Optional[Mapping[str, str]] = None) -> Path:
    """The project checkout every command acts for: $SLIPWAY_PROJECT, else the working directory.
    A value that names no directory is refused: a typo must not become a new, empty project."""
    value = _text("SLIPWAY_PROJECT", environ)
    if value is None:
        return Path(os.getcwd()).absolute()
    path = Path(_no_nul("SLIPWAY_PROJECT", value)).expanduser().absolute()
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        raise ConfigError("$SLIPWAY_PROJECT", f"{bounded_path(path)} {what}: point it at the project's checkout, "
                                              "or unset it to use the working directory")
    return path


def runs_dir(project: Path, environ: Optional[Mapping[str, str]] = None) -> Path:
    """Where runs live: $SLIPWAY_RUNS (relative to the project), else the project's runs/. Its parent
    must exist: a submission creates the runs directory, never a tree of a mistyped path."""
    value = _text("SLIPWAY_RUNS", environ)
    if value is None:
        return (project / "runs").absolute()
    path = (project / Path(_no_nul("SLIPWAY_RUNS", value)).expanduser()).absolute()
    if path.exists() and not path.is_dir():
        raise ConfigError("$SLIPWAY_RUNS", f"{bounded_path(path)} is not a directory: point it at the directory "
                                           "that holds the runs, or unset it to use the project's runs/")
    if not path.parent.is_dir():
        raise ConfigError("$SLIPWAY_RUNS", f"{bounded_path(path.parent)} does not exist, so neither can "
                                           f"{bounded_path(path.name)} in it: create it, or fix the variable")
    return path


def seconds(name: str, default: float, environ: Optional[Mapping[str, str]] = None) -> float:
    """A positive duration in seconds from the environment, checked; `default` where it is unset."""
    value = _text(name, environ)
    if value is None:
        return default
    try:
        number = float(value) if len(value) <= 40 else float("nan")
    except ValueError:
        number = float("nan")
    if not (0 < number < 10 ** 9):
        raise ConfigError(f"${name}", f"{shown(value)} is not a number of seconds (a positive number such as "
                                      f"{default:g}): fix it, or unset it for {default:g}")
    return number


def _no_nul(name: str, value: str) -> str:
    if "\0" in value or len(value) > 4096:
        raise ConfigError(f"${name}", "is not a path (a NUL byte, or longer than any path): fix it, or unset it")
    return value


def job_id(environ: Optional[Mapping[str, str]] = None, name: str = "SLURM_JOB_ID") -> Optional[str]:
    """The Slurm job id the environment names (None: none), checked."""
    return _value(name, JOB_ID, "a Slurm job id (a whole number)", environ)


def word(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """A name from the environment that goes into file names (a node's name, a job's tag), checked."""
    return _value(name, WORD, "a name of letters, digits, '.', '_' and '-'", environ)


def count(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """A whole number from the environment (a node count, a rank), checked."""
    value = _value(name, COUNT, "a whole number", environ)
    return None if value is None else int(value)


HOSTLIST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._,\[\]-]{0,65535}")  # SLURM_JOB_NODELIST: `nid[001-004],gpu7`


def allocation(environ: Optional[Mapping[str, str]] = None) -> tuple[Optional[str], Optional[int]]:
    """(job id, node count) of the allocation this shell is in (`slipway run`), (None, None) outside
    one; every SLURM_* value the batch script then reads in names of files, events and commands checked."""
    job = job_id(environ)
    if job is None:
        return None, None
    _value("SLURM_JOB_NODELIST", HOSTLIST, "a Slurm host list such as nid[001-004]", environ)
    word("SLURM_JOB_PARTITION", environ)
    count("SLURM_RESTART_COUNT", environ)
    nodes = count("SLURM_JOB_NUM_NODES", environ)
    return job, count("SLURM_NNODES", environ) if nodes is None else nodes
CPUS_PER_NODE = re.compile(r"[0-9]{1,6}(\(x[0-9]{1,6}\))?(,[0-9]{1,6}(\(x[0-9]{1,6}\))?){0,4095}")


def fewest_cpus(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The fewest CPUs the allocation has on one of its nodes (SLURM_JOB_CPUS_PER_NODE, `4(x2),2`), checked."""
    value = _value("SLURM_JOB_CPUS_PER_NODE", CPUS_PER_NODE, "a list of CPU counts such as 4(x2),2", environ)
    return None if value is None else min(int(part.split("(")[0]) for part in value.split(","))


def invocation() -> str:
    """How a suggested command runs this slipway from this shell: `slipway` where PATH finds this one, else
    the `slipway` beside this interpreter (`make setup`'s `.venv/bin/slipway` is not on PATH), else `python -m jobs`."""
    script = Path(sys.executable).parent / "slipway"
    found = shutil.which("slipway")
    with contextlib.suppress(OSError):
        if found and (not script.exists() or os.path.samefile(found, script)):
            return "slipway"
    if not script.exists():
        return f"{shlex.quote(sys.executable)} -m jobs"
    relative = os.path.relpath(script)
    return shlex.quote(relative if not relative.startswith("..") else str(script))


# The config arguments of the command running (`Config.config_args`): what a suggestion's CONFIG stands
# for, wherever its text was written (the trainer's messages cannot know the user's command line).
_config_args: Optional[str] = None


def given_config(config_args: str) -> None:
    global _config_args
    _config_args = config_args


_SUGGESTED = re.compile(r"(`|\$\()slipway ([^`)]*)")


def as_typed(text: str, config_args: Optional[str] = None) -> str:
    """`text` with each command it suggests (`` `slipway ...` ``, `$(slipway ...)`) as this shell runs it,
    CONFIG replaced by the config arguments (else the running command's): a hint must work when pasted."""
    if "slipway " not in text:
        return text
    prog, args = invocation(), config_args or _config_args

    def typed(m: re.Match) -> str:
        words = re.sub(r"(?<![\w./-])CONFIG(?![\w./-])", lambda _: args, m.group(2)) if args else m.group(2)
        return f"{m.group(1)}{prog} {words}"

    return _SUGGESTED.sub(typed, text)
