"""Errors from input, and how a message quotes what the user gave.

`ConfigError` is the one error for bad input: one line naming the field, the rule and the fix (the
error edge, common/edge.py, prints it and exits 2). Every message quoting a value goes through
`shown`, and every error's line is masked by the secret policy (common/secrets.py) as it is made.
"""

from __future__ import annotations

import functools
import re
import shlex
import sys
from typing import Any, Optional

from common.secrets import mask, plugins


class ConfigError(ValueError):
    """Bad user input: one line naming the field, the rule and the fix."""

    def __init__(self, field_path: str, message: str):
        # One line, whatever the user typed, never past a screenful; a secret given as a mapping's
        # key is masked in the path too, judged part by part.
        self.field = bounded(_PART.sub(lambda m: _masked(m.group()), mask(one_line(field_path))), MAX_FIELD_SHOWN)
        message = _QUOTED.sub(lambda m: mask(m.group(), values=True), mask(one_line(message)))
        if len(message) > MAX_MESSAGE:  # keep the start (the rule) and the end (the fix)
            message = f"{message[:MAX_MESSAGE // 2]} ... {message[-MAX_MESSAGE // 2:]}"
        super().__init__(f"{self.field}: {message}" if self.field else message)


# What a message quotes (a value as repr or `...` shows it) is what the user gave: judged by the
# secret policy as a value, word by word (a random-looking key is hidden whole, common/secrets.py).
_QUOTED = re.compile(r"'[^'\n]*'|\"[^\"\n]*\"|`[^`\n]*`")
_PART = re.compile(r"[^.\[\]]+")
MAX_SHOWN = 80  # characters of a value quoted in an error message
MAX_FIELD_SHOWN = 400
MAX_MESSAGE = 1000


# What would end a line, drive a terminal or reorder what it shows: every break str.splitlines()
# knows (\v, \f, \x1c-\x1e, NEL, U+2028/9, \n, \r), the C0 and C1 controls (ESC starts every
# terminal sequence; a tab breaks a column) and Unicode's bidirectional controls.
UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


_BREAKS = re.compile("[\x00\n\r\v\f\x1c-\x1e\x85\u2028\u2029]")  # what ends a line (and NUL)


def unprintable(text: str, breaks: bool = False) -> Optional[str]:
    """The first character `one_line` escapes (`breaks`: the first line break or NUL) as it shows it, or None."""
    found = (_BREAKS if breaks else UNPRINTABLE).search(text)
    return one_line(found[0]) if found else None


def one_line(text: object) -> str:
    """`text` as one line, a line break or (bidirectional) control shown escaped (`\\x1b`, `\\u202e`): the one
    way from a file, a job, a run name, Slurm or the environment to any terminal slipway prints to."""
    text = str(text)
    if text.isprintable():  # no control, break or format character: the common case, in C
        return text
    return UNPRINTABLE.sub(lambda m: _ESCAPES.get(m[0]) or ascii(m[0])[1:-1], text)


def pasteable(word: str) -> str:
    """`word` as one shell word a pasted command gives back whole: shlex's quoting, or where it holds
    what `one_line` escapes, bash's $'...' with their bytes escaped (`$'n\\x1bode'`), safe on a terminal."""
    if word.isprintable():
        return shlex.quote(word)
    return "$'" + "".join("\\" + c if c in "\\'" else c if c.isprintable() else
                          "".join(f"\\x{b:02x}" for b in c.encode()) for c in word) + "'"  # bytes: any locale


@functools.lru_cache(maxsize=4096)
def _masked(text: str) -> str:
    """`mask` of a value the user gave, remembered: config checks quote the same values again and again."""
    return mask(text, values=True)


def bounded(text: str, limit: int = MAX_SHOWN) -> str:
    """`text` cut to `limit` characters with `...`, masked first: no cut leaves a secret too short to recognise."""
    text = _masked(str(text))
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def failure_line(output: str) -> str:
    """The last error line of a process's output, else its last line; whitespace collapsed, 300 characters."""
    lines = [" ".join(line.split()) for line in str(output).splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"(Error|Exception|error:|FAILED)", line)]
    return ((errors or lines or ["no output"])[-1])[:300]


def human(n: float) -> str:
    """Bytes for a message: 12 B, 3.4 KiB ... 1.2 TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


MAX_PATH_SHOWN = 400  # a path is what the user must find: longer than other values, cut in the middle


def bounded_path(path: object) -> str:
    """A path for a message: whole up to MAX_PATH_SHOWN characters, else its start and end around `...`."""
    text = mask(str(path))
    if len(text) <= MAX_PATH_SHOWN:
        return text
    half = (MAX_PATH_SHOWN - 3) // 2
    return f"{text[:half]}...{text[-half:]}"


def shown(value: Any, where: str = "") -> str:
    """A value as the user wrote it, for every message quoting one: about MAX_SHOWN characters at most, hidden
    whole where `where`'s last part looks like a secret's name; any other's secret-looking parts masked."""
    if where and plugins().secret_name(re.split(r"[.\[]", where)[-1] or where):
        return "<a value, hidden: the name looks like a secret's>"
    return bounded(_brief(value, MAX_SHOWN), 2 * MAX_SHOWN)


def warn(message: str) -> None:
    """A warning on stderr, one line, masked: the user's own text, not refused (launch.pre_launch, an EDF)."""
    print(f"slipway: warning: {mask(one_line(message))}", file=sys.stderr)


def _brief(value: Any, room: int) -> str:
    """repr(value), but stopping once about `room` characters are written (each level of a
    nested value costs at least two, so the recursion ends too)."""
    if value is None:
        return "null"
    if isinstance(value, str):  # masked before it is cut (a token cut short is no longer recognised)
        value = _masked(str(value))
        return repr(value if len(value) <= room else value[:max(room - 5, 1)] + "...")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 30:
        return f"<a {len(str(abs(value))) if abs(value) < 10 ** 4000 else 'huge'}-digit number>"
    if isinstance(value, (list, tuple, dict)):
        items = value.items() if isinstance(value, dict) else value
        parts, used = [], 2
        for item in items:
            if used >= room:
                parts.append("...")
                break
            text = (f"{_brief(item[0], room - used)}: {_brief(item[1], room - used)}" if isinstance(value, dict)
                    else _brief(item, room - used))
            parts.append(text)
            used += len(text) + 2
        return ("{%s}" if isinstance(value, dict) else "[%s]") % ", ".join(parts)
    return repr(value)[:max(room, 8)]

