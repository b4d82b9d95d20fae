"""The one record type of the lines a job writes for a reader: `TAG key=value ... [REST: text]`
(a save, a hang dump's head, a bad node). A record is a frozen dataclass whose fields are its keys,
in order (`key()` renames one or sets how it is written); the field REST names is free text after
`REST: `. job_lib.sh's `line_field` reads the same words in bash. Stdlib only: the trainer writes some.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from pathlib import Path
from typing import Any, ClassVar, Optional, TypeVar

from common.fs import append_line

T = TypeVar("T", bound="TaggedLine")


def key(name: str, fmt: str = "{}", words: Optional[tuple[str, str]] = None) -> Any:
    """A field written `name=VALUE`: by `fmt`, or a bool as one of two `words` (false's first)."""
    return dataclasses.field(metadata={"key": name, "fmt": fmt, "words": words})


class TaggedLine:
    TAG: ClassVar[str]
    REST: ClassVar[str] = ""

    @classmethod
    @functools.cache
    def _keys(cls) -> list[tuple[str, str, Any, dict]]:
        """(field, key, type, metadata) of each field, in order."""
        hints = typing.get_type_hints(cls)
        return [(f.name, f.metadata.get("key", f.name), hints[f.name], f.metadata) for f in dataclasses.fields(cls)]

    def line(self) -> str:
        words = [self.TAG]
        for name, word, _, meta in self._keys():
            value = getattr(self, name)
            if name == self.REST:
                words.append(f"{word}: {value}")
            else:
                words.append(f"{word}={meta['words'][value] if meta.get('words') else meta.get('fmt', '{}').format(value)}")
        return " ".join(words)

    @classmethod
    def parse(cls: type[T], line: str) -> Optional[T]:
        """The record of `line`; None for another tag's, or one missing a key or holding a bad value."""
        head, sep, rest = line.partition(f" {cls.REST}: ") if cls.REST else (line, "", "")
        words = head.split()
        if (cls.REST and not sep) or not words or words[0] != cls.TAG:
            return None
        keys = dict(w.split("=", 1) for w in words[1:] if "=" in w)
        values: dict[str, Any] = {}
        try:
            for name, word, kind, meta in cls._keys():
                if name == cls.REST:
                    values[name] = rest.strip()
                else:
                    values[name] = keys[word] == meta["words"][1] if meta.get("words") else kind(keys[word])
        except (KeyError, ValueError):
            return None
        record = cls(**values)
        return record if record.valid() else None

    def valid(self) -> bool:
        """What a record's values must hold beyond their types."""
        return True

    def append_to(self, path: Path) -> None:
        append_line(path, self.line())
