"""Bounded YAML: configs, overrides, EDF files and the frozen runs/RUN/config.yaml, by the schema's
rules, never YAML 1.1's (PyYAML's: `10:00` is 600, `0123` is 83, `yes` is true, a second `train:`
silently replaces the first). Plain scalars but YAML 1.2's null stay the text written (`Plain`), for
the field they land in to convert (common/schema.py); a duplicate key is an error naming both lines.
"""

from __future__ import annotations

import errno
import re
from pathlib import Path
from typing import Any, Optional

import yaml

from common.errors import ConfigError, bounded, shown
from common.fs import read_file



class Plain(str):
    """A plain (unquoted) YAML scalar or an override value, exactly as written."""


# YAML 1.2's forms of null, booleans and numbers: what the schema engine (common/schema.py) types a
# plain scalar by, once the field it lands in says which type it must be.
NULL = frozenset({"null", "Null", "NULL", "~"})
BOOL = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}
INT = re.compile(r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+")
FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2's null as the only implicit type, and no duplicate keys."""

    yaml_implicit_resolvers: dict = {}

    def construct_yaml_str(self, node: yaml.Node) -> str:
        value = self.construct_scalar(node)
        if node.style is None:  # plain: null, or text for the schema to type
            return None if value in NULL or value == "" else Plain(value)
        return str(value)

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict:
        if not isinstance(node, yaml.MappingNode):
            return super().construct_mapping(node, deep=deep)
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, str):
                raise ConfigError(f"line {line}", f"key {shown(key)} is not a string: keys are names such as "
                                                  "train or steps")
            if key in seen:
                raise ConfigError(f"line {line}", f"duplicate key {shown(key)} (first at line {seen[key]}): "
                                  "YAML keeps only one of them; merge the two into one")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)

    # A config is a few hundred short lines: these bounds refuse a "billion laughs" of nested aliases
    # or a document nested hundreds deep before it is built, not after exhausting time or memory.
    def compose_document(self) -> yaml.Node:
        self._depth, self._aliases = 0, 0
        node = super().compose_document()
        _expanded_size(node, 1, {}, [0])
        return node

    def compose_node(self, parent: Optional[yaml.Node], index: Any) -> yaml.Node:
        line = self.peek_event().start_mark.line + 1
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise ConfigError(f"line {line}", f"more than {MAX_ALIASES} aliases (*name): a config needs a "
                                                  "few; write the values out")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise ConfigError(f"line {line}", f"nested deeper than {MAX_DEPTH} levels: no config field takes "
                                                  "that; flatten it")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


MAX_TEXT = 1_000_000  # characters of a config file or an override
MAX_DEPTH = 32  # levels of nested mappings and lists, aliases expanded
MAX_ALIASES = 100
MAX_NODES = 100_000  # values in a document with its aliases expanded
MAX_INT = 2 ** 53 - 1  # exact in a float and in JSON, well within bash's 64-bit arithmetic


def _expanded_size(node: yaml.Node, depth: int, seen: dict[int, tuple[int, int]], count: list[int]) -> tuple[int, int]:
    """(height, values below) of `node`, aliases expanded (a shared node measured once, counted each
    time it is used); a document deeper than MAX_DEPTH or larger than MAX_NODES refused."""
    where = f"line {node.start_mark.line + 1}"
    known = seen.get(id(node))
    if known is None:
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        sizes = [_expanded_size(child, depth + 1, seen, count) for child in children]
        known = seen[id(node)] = (1 + max((h for h, _ in sizes), default=0), sum(1 + n for _, n in sizes))
    else:
        count[0] += known[1]
    count[0] += 1
    if depth + known[0] - 1 > MAX_DEPTH:
        raise ConfigError(where, f"nested deeper than {MAX_DEPTH} levels (aliases expanded): no config field takes "
                                 "that; flatten it")
    if count[0] > MAX_NODES:
        raise ConfigError(where, f"more than {MAX_NODES} values once its aliases (*name) are expanded: a config "
                                 "needs far fewer; write the values out")
    return known


_Loader.add_constructor("tag:yaml.org,2002:str", _Loader.construct_yaml_str)
_Loader.add_implicit_resolver("tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""])


def read_yaml(text: str, source: str, *, lines: bool = True) -> Any:
    """`text` parsed by the rules above; `source` (a file, or an override's field: `lines=False`) names it in errors."""
    if len(text) > MAX_TEXT:
        raise ConfigError(source, f"{len(text)} characters: larger than any config ({MAX_TEXT} at most); "
                                  "check that this is the file you meant")
    try:
        return yaml.load(text, Loader=_Loader)
    except ConfigError as exc:
        raise ConfigError(f"{source} {exc.field}" if exc.field else source, str(exc).split(": ", 1)[-1]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source} line {mark.line + 1}" if mark is not None and lines else source
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(where, f"not valid YAML ({' '.join(str(problem).split())}): check the quoting and "
                                 "indentation there") from None


def line_of(text: str, dotted: str) -> Optional[int]:
    """The line of YAML `text` where the key `dotted` (section.key...) is written, None where it is not."""
    try:
        node = yaml.compose(text, Loader=_Loader)
    except (yaml.YAMLError, ConfigError):
        return None
    line = None
    for part in dotted.split("."):
        found = [(k, v) for k, v in node.value if getattr(k, "value", None) == part] if isinstance(
            node, yaml.MappingNode) else []
        if not found:
            return None
        line, node = found[0][0].start_mark.line + 1, found[0][1]
    return line


def at_line(exc: ConfigError, path: Path, dotted: str, named: bool = True) -> ConfigError:
    """`exc` with the line where `dotted` is written in `path`, where it is (read again on this error
    alone: a file gone or changed since only loses the line), and the file's name unless `exc` has it."""
    try:
        line = line_of(read_text_bounded(path, str(path)), dotted)
    except (OSError, UnicodeError, ConfigError):
        line = None
    where = f"{path} line" if named else "line"
    return exc if line is None else ConfigError(exc.field, f"{where} {line}: {str(exc)[len(exc.field) + 2:]}")


def read_text_bounded(path: Path, where: str, limit: int = MAX_TEXT) -> str:
    """The UTF-8 text of `path`, refused unread when larger than `limit`; a path that is no regular file
    (a FIFO, a device) raises NotRegularFile at once."""
    found = read_file(path, limit)
    if found is None:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
    data = found[0]
    if data is None:
        raise ConfigError(where, f"{bounded(str(path))} is larger than {limit} bytes, more than any config or "
                                 "EDF holds: check that this is the file you meant")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(where, f"{bounded(str(path))} is not UTF-8 text (byte {exc.start}): save it as "
                                 "UTF-8") from None

