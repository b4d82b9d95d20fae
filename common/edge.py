"""The command line's edge: every error from what the user gave becomes one line and exit 2. Each
entry point runs its work through `run_at_edge`, so an error class a new field brings (a path part
too long, a document nested too deeply) is caught here once, not field by field; a genuine bug gets
one line saying it is one (`SLIPWAY_DEBUG=1`: the traceback). No torch, nothing of the host side.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import os
import re
import sys
from typing import Callable, Optional

from common.environ import as_typed
from common.errors import ConfigError, bounded, bounded_path, one_line
from common.fs import closed_by
from common.rundir import BAD_INPUT_EXIT, BUG_EXIT, FAILED_EXIT
from common.secrets import mask

DEBUG_VARIABLE = "SLIPWAY_DEBUG"
# errnos that say "this path is not usable", whatever code path met it.
_PATH_ERRNOS = {errno.ENAMETOOLONG, errno.ENOENT, errno.EACCES, errno.EPERM, errno.ELOOP, errno.ENOTDIR,
                errno.EISDIR, errno.EEXIST, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EINVAL}


def error_line(exc: BaseException) -> tuple[str, int]:
    """(the one line to print, without the program name, and the exit status) for `exc`."""
    if isinstance(exc, ConfigError):
        return str(exc), BAD_INPUT_EXIT
    if isinstance(exc, RecursionError):
        return ("input: nested too deeply to read (a list or table inside another, hundreds of levels): "
                "flatten it"), BAD_INPUT_EXIT
    if isinstance(exc, MemoryError):
        return "input: too large to hold in memory: make the config or file smaller", BAD_INPUT_EXIT
    if isinstance(exc, OSError):
        name = exc.filename if exc.filename is not None else exc.filename2
        reason = exc.strerror or type(exc).__name__
        if name is not None:
            fix = ("shorten the path (each name at most 255 bytes)" if exc.errno == errno.ENAMETOOLONG
                   else "check the path and its permissions")
            shown = os.fsdecode(name) if isinstance(name, (str, bytes, os.PathLike)) else str(name)
            closed = closed_by(shown) if isinstance(exc, PermissionError) else None
            if closed and closed[1]:  # whose it is: a teammate's folder is no typo to fix
                where = "it is" if str(closed[0]) == os.path.abspath(shown) else f"{bounded_path(closed[0])} is"
                reason = f"{reason} ({where} {closed[1]})"
            return f"{bounded_path(shown)}: {reason}: {fix}", BAD_INPUT_EXIT
        if exc.errno in _PATH_ERRNOS:
            return f"{reason}: check the paths in the config and on the command line", BAD_INPUT_EXIT
        return f"{bounded(str(exc))} (an operating system error, not a problem in the config)", FAILED_EXIT
    if isinstance(exc, UnicodeError):
        return f"input: not valid text ({bounded(str(exc))}): save the file as UTF-8", BAD_INPUT_EXIT
    return (f"internal error {type(exc).__name__}: {bounded(str(exc))}: this is a bug in slipway; rerun with "
            f"{DEBUG_VARIABLE}=1 for the traceback and report it"), BUG_EXIT


def run_at_edge(work: Callable[[], int], prog: str = "slipway",
                handled: Optional[Callable[[BaseException], Optional[int]]] = None, *,
                errors: Optional[dict[type, int]] = None, crashes: bool = False, silent: bool = False) -> int:
    """`work()`'s exit status; any exception it raises printed as one line (`error_line`). `handled`
    may take an exception first (returning a status); `errors`: the work's own exception classes and
    their exit statuses (the trainer's non-finite stop). `crashes`: any other error but a ConfigError
    is the work's crash, not slipway's bug, and propagates with its traceback (exit 1), as a training
    process's must for the log. `silent`: say nothing (every rank but the first, so that an error is one line)."""
    stdout = sys.stdout
    sys.stdout = _Stdout(stdout)  # type: ignore[assignment]
    try:
        try:
            status = work()
        except SystemExit:  # argparse's --help, and its errors: what they printed is flushed too
            sys.stdout.flush()
            raise
        sys.stdout.flush()  # here, not at exit: a full disk or a closed pipe is then told like any error
        return status
    except Exception as exc:  # not KeyboardInterrupt: Ctrl-C keeps its traceback and exit code
        if isinstance(exc, OutputError):  # stdout to /dev/null: its buffer dropped, the flush at exit silent
            with contextlib.suppress(OSError, ValueError, AttributeError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            if not silent:
                with contextlib.suppress(OSError):
                    print(f"{prog + ': ' if prog else ''}error: {exc}", file=sys.stderr)
            return FAILED_EXIT
        if handled is not None:
            status = handled(exc)
            if status is not None:
                return status
        if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
            raise
        own = next((code for kind, code in (errors or {}).items() if isinstance(exc, kind)), None)
        if crashes and own is None and not isinstance(exc, ConfigError):
            raise
        line, status = (str(exc), own) if own is not None else error_line(exc)
        line = as_typed(line) if prog == "slipway" else line  # its suggested commands, as this shell runs them
        if not silent:  # masked once more (judged word by word too), and escaped: an argument echoed back is the user's
            print(f"{prog + ': ' if prog else ''}error: {mask(one_line(' '.join(line.split())), values=True)}",
                  file=sys.stderr)
        return status
    finally:
        sys.stdout = stdout


_OUTPUT_ERRNOS = {errno.EPIPE: "closed before all of it was written (the reader of the pipe ended)",
                  errno.ENOSPC: "the disk or device it goes to is full", errno.EDQUOT: "the disk quota is used up",
                  errno.EFBIG: "the file it goes to is too large", errno.EIO: "an I/O error on the device it goes to"}


class OutputError(OSError):
    """A write to stdout failed: named as such, never blamed on the config or a path."""

    def __init__(self, exc: OSError):
        why = _OUTPUT_ERRNOS.get(exc.errno, exc.strerror or type(exc).__name__)
        super().__init__(exc.errno, f"stdout: {why}: the output could not be written (not a problem in the config)")

    def __str__(self) -> str:
        return self.strerror


class _Stdout:
    """sys.stdout while a command runs: a write error names no file, so this says it was stdout's
    (whatever wrote: print, rich, a log copied through)."""

    def __init__(self, stream):
        self._stream = stream
        self._failed: Optional[OSError] = None  # a failure some writer swallowed (argparse does)

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as exc:
            self._failed = exc
            raise OutputError(exc) from exc

    def flush(self):
        try:
            self._stream.flush()
        except OSError as exc:
            self._failed = exc
        if self._failed is not None:
            raise OutputError(self._failed) from self._failed

    def __getattr__(self, name):
        return getattr(self._stream, name)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors, like every other slipway error: every entry point's parser."""

    def error(self, message: str):
        # argparse quotes what it could not read (`invalid int value: '999...'`): bounded, one line,
        # masked by the secret policy and escaped; the help it points to as this shell runs slipway.
        # A misspelt command or flag gets the nearest one (a stray's candidates: this command's help).
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        flags = re.findall(r"(?<![\w-])--?[a-z][\w-]*", self.format_help())
        near = (_nearest(choice[1], re.findall(r"'([^']*)'", choice[2])) if choice else next(
            (n for w in message.split()[2:] if w.startswith("-") and (n := _nearest(w.split("=")[0], flags))), "")
            if message.startswith("unrecognized arguments: ") else "")
        message = one_line(" ".join(bounded(message, 300).split())) + (f"; did you mean {near}?" if near else "")
        name = "slipway" if self.prog.startswith("slipway") else self.prog
        self.exit(BAD_INPUT_EXIT, f"{name}: error: {message} ({as_typed(f'see `{self.prog} --help`')})\n")


def _nearest(word: str, candidates: list[str]) -> str:
    """The candidate nearest to `word` (difflib's closest, `_` read as `-`), "" where none is near."""
    near = difflib.get_close_matches(word.replace("_", "-"), candidates, n=1, cutoff=0.6)
    return near[0] if near else ""
