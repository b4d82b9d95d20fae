"""Values slipway takes from its environment, checked like config values: the environment is input.

Slurm's variables land in paths (the job id in a log's name, a node's name in a hang dump's), in
command lines and in arithmetic. A value of the wrong shape (`../x`, `1;rm -rf ~`, an empty node
name) is refused where it is read, in one line naming the variable, whatever set it: a shell
left over from another allocation, a user's export, a wrapper script.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Mapping, Optional

from common.errors import ConfigError, shown

JOB_ID = re.compile(r"[0-9]{1,12}")  # SLURM_JOB_ID: an array task's own id is one too
WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # a name that is safe as a file name's part
COUNT = re.compile(r"[0-9]{1,7}")


def _value(name: str, pattern: re.Pattern, what: str, environ: Optional[Mapping[str, str]]) -> Optional[str]:
    value = (os.environ if environ is None else environ).get(name)
    if value is None or value == "":
        return None
    if not pattern.fullmatch(value):
        raise ConfigError(f"${name}", f"{shown(value)} is not {what}, as Slurm sets it: unset it, or run "
                                      "slipway from a shell of the job or allocation that set it")
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


CPUS_PER_NODE = re.compile(r"[0-9]{1,6}(\(x[0-9]{1,6}\))?(,[0-9]{1,6}(\(x[0-9]{1,6}\))?){0,4095}")


def fewest_cpus(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The fewest CPUs the allocation has on one of its nodes (SLURM_JOB_CPUS_PER_NODE, `4(x2),2`), checked."""
    value = _value("SLURM_JOB_CPUS_PER_NODE", CPUS_PER_NODE, "a list of CPU counts such as 4(x2),2", environ)
    return None if value is None else min(int(part.split("(")[0]) for part in value.split(","))


def invocation() -> str:
    """How to run this slipway from the shell it was started in, as a suggested command shows it:
    `slipway` where that name on PATH is this installation; else its `slipway` beside this
    interpreter, relative to the working directory below it (`make setup` leaves the user with
    `.venv/bin/slipway`, not on PATH); else `python -m jobs` with this interpreter."""
    script = Path(sys.executable).parent / "slipway"
    found = shutil.which("slipway")
    try:
        if found and (not script.exists() or os.path.samefile(found, script)):
            return "slipway"
    except OSError:
        pass
    if not script.exists():
        return f"{shlex.quote(sys.executable)} -m jobs"
    relative = os.path.relpath(script)
    return shlex.quote(relative if not relative.startswith("..") else str(script))


def as_typed(text: str) -> str:
    """`text` with each command it suggests (`` `slipway ...` ``, `$(slipway ...)`) in the form
    this shell runs (`invocation`): a hint must work when pasted."""
    prog = invocation()
    if prog == "slipway":
        return text
    return text.replace("`slipway ", f"`{prog} ").replace("$(slipway ", f"$({prog} ")
