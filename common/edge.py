"""The command line's edge: every error from what the user gave becomes one line and exit 2.

Each entry point (`slipway`, `python -m trainer.prepare`) runs its
work through `run_at_edge`, so an error class a new field brings (a path component longer
than the filesystem takes, a document nested too deeply) is caught here once instead of
field by field. A genuine bug still gets one line, saying it is one; `SLIPWAY_DEBUG=1`
shows the traceback instead. Imports neither torch nor the host side (the trainer uses it).
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Callable, Optional

from common.environ import as_typed
from common.errors import ConfigError, bounded, bounded_path
from common.secrets import mask

USER_ERROR = 2
BUG = 70  # EX_SOFTWARE: told apart from a refused input (2) and a failed Slurm call (1)
DEBUG_VARIABLE = "SLIPWAY_DEBUG"
# errnos that say "this path is not usable", whatever code path met it.
_PATH_ERRNOS = {errno.ENAMETOOLONG, errno.ENOENT, errno.EACCES, errno.EPERM, errno.ELOOP, errno.ENOTDIR,
                errno.EISDIR, errno.EEXIST, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EINVAL}


def error_line(exc: BaseException) -> tuple[str, int]:
    """(the one line to print, without the program name, and the exit status) for `exc`."""
    if isinstance(exc, ConfigError):
        return str(exc), USER_ERROR
    if isinstance(exc, RecursionError):
        return ("input: nested too deeply to read (a list or table inside another, hundreds of levels): "
                "flatten it"), USER_ERROR
    if isinstance(exc, MemoryError):
        return "input: too large to hold in memory: make the config or file smaller", USER_ERROR
    if isinstance(exc, OSError):
        name = exc.filename if exc.filename is not None else exc.filename2
        reason = exc.strerror or type(exc).__name__
        if name is not None:
            fix = ("shorten the path (each name at most 255 bytes)" if exc.errno == errno.ENAMETOOLONG
                   else "check the path and its permissions")
            shown = os.fsdecode(name) if isinstance(name, (str, bytes, os.PathLike)) else str(name)
            return f"{bounded_path(shown)}: {reason}: {fix}", USER_ERROR
        if exc.errno in _PATH_ERRNOS:
            return f"{reason}: check the paths in the config and on the command line", USER_ERROR
        return f"{bounded(str(exc))} (an operating system error, not a problem in the config)", 1
    if isinstance(exc, UnicodeError):
        return f"input: not valid text ({bounded(str(exc))}): save the file as UTF-8", USER_ERROR
    return (f"internal error {type(exc).__name__}: {bounded(str(exc))}: this is a bug in slipway; rerun with "
            f"{DEBUG_VARIABLE}=1 for the traceback and report it"), BUG


def run_at_edge(work: Callable[[], int], prog: str = "slipway",
                handled: Optional[Callable[[BaseException], Optional[int]]] = None) -> int:
    """`work()`'s exit status; any exception it raises printed as one line (see `error_line`).

    `handled` may deal with an exception itself (returning a status) before the generic rules."""
    try:
        return work()
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        if handled is not None:
            status = handled(exc)
            if status is not None:
                return status
        if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
            raise
        line, status = error_line(exc)  # masked once more: an error no slipway code worded may quote a value
        line = as_typed(line) if prog == "slipway" else line  # its suggested commands, as this shell runs them
        # judged word by word too: an argument echoed back (a run's name) is what the user gave
        print(f"{prog}: error: {mask(' '.join(line.split()), values=True)}", file=sys.stderr)
        return status
