"""docs/config.md, generated from the config schema: `python -m jobs.cli.reference`.

Every key of every section of `jobs.config.Config`, with its type, its default and its
meaning. The meaning is the `#` comment above the field (or at the end of its line) in the
dataclass's own source, and a section's docstring is its intro: the schema's source is the
one place meanings live, and this page is never edited by hand. `--check` exits 1 with a
diff when the page is stale (tests/test_docs.py runs the same comparison).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import io
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from edf.environment import Mount
from jobs.config import NODE_PRESETS, Config
from common.schema import AutoBool, config_fields
from trainer.config import MODEL_PRESETS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config.md"
COMMAND = "python -m jobs.cli.reference"

# Types with a text form of their own (the schema reads them with `from_config_value`).
CUSTOM_TYPES = {
    Mount: "mount",
    AutoBool: "`true`, `false` or `auto`",
}
SCALARS = {str: "string", int: "integer", float: "number", bool: "`true` or `false`"}


def type_text(tp: Any) -> str:
    """A field's type as a reader writes its value."""
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(f"`{_yaml(a)}`" for a in get_args(tp))
    if origin in (Union, types.UnionType):
        inner = [type_text(a) for a in get_args(tp) if a is not type(None)]
        return ", ".join(t.removeprefix("one of ").replace(" or ", ", ") for t in inner) + " or `null`"
    if origin is list:
        return f"list of {_plural(type_text(get_args(tp)[0]))}"
    if origin is dict:
        key, value = get_args(tp)
        return f"mapping of {type_text(key)} to {type_text(value)}"
    if tp in CUSTOM_TYPES:
        return CUSTOM_TYPES[tp]
    if tp in SCALARS:
        return SCALARS[tp]
    raise TypeError(f"no readable name for config type {tp!r}: add it to jobs.cli.reference.CUSTOM_TYPES")


def _plural(text: str) -> str:
    return {"string": "strings", "integer": "integers", "number": "numbers",
            "mount": "mounts `SRC[:DST[:FLAGS]]`"}.get(text, text + "s")


def _yaml(value: Any) -> str:
    """`value` as it would be written in a config file (flow style, one line)."""
    if dataclasses.is_dataclass(value):
        raise TypeError("sections have no one-line default")
    if isinstance(value, Mount):
        value = value.spec()
    if value == "":
        return '""'
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    return f"`{_yaml(value)}`"


def field_comments(cls: type) -> dict[str, str]:
    """The `#` comments that describe each field of dataclass `cls`: the comment lines right
    above it (up to a blank line or another statement) and a comment at the end of its line."""
    lines, _ = inspect.getsourcelines(cls)
    source = textwrap.dedent("".join(lines))
    comments: dict[int, str] = {}  # line (1-based, in `source`) -> comment text
    own_line: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row = tok.start[0]
            comments[row] = tok.string.lstrip("#").strip()
            if not tok.line[: tok.start[1]].strip():
                own_line.add(row)
    (node,) = ast.parse(source).body
    out: dict[str, str] = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above: list[str] = []
        row = stmt.lineno - 1
        while row >= 1 and row in own_line:
            above.insert(0, comments[row])
            row -= 1
        trailing = [comments[r] for r in range(stmt.lineno, stmt.end_lineno + 1)
                    if r in comments and r not in own_line]
        out[stmt.target.id] = " ".join(part for part in above + trailing if part)
    return out


def _section_intro(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    if cls.__doc__ is None or doc.startswith(cls.__name__ + "("):  # dataclass's generated signature
        return ""
    return doc


def missing_descriptions() -> list[str]:
    """Config keys whose field has no comment in the schema's source (the test lists them)."""
    hints = typing.get_type_hints(Config)
    missing = []
    for section in config_fields(Config):
        cls = hints[section]
        comments = field_comments(cls)
        missing += [f"{section}.{name}" for name in config_fields(cls) if not comments.get(name)]
    return missing


def render() -> str:
    """The whole page."""
    hints = typing.get_type_hints(Config)
    sections = list(config_fields(Config))
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated by `{COMMAND}` from the config schema's source (jobs/config.py,",
        "     trainer/config.py, edf/environment.py): edit the comments there, not this page. -->",
        "",
        "A config (`configs/NAME.yaml`) holds these sections; every key is optional and has the",
        "default shown. Any key can be overridden on the command line as `SECTION.KEY=VALUE`",
        "(`train.steps=100`, `slurm.account=a-01`, `container.mounts=[${SCRATCH}:/s, /users]`):",
        "values are typed by the field they set, so `slurm.time=10:00` stays ten minutes and",
        "`slurm.account=0123` stays `0123`. An unknown key is an error that lists the valid ones.",
        "",
        "Sections: " + ", ".join(f"[`{s}`](#{s})" for s in sections) + ".",
        "",
    ]
    for section in sections:
        cls = hints[section]
        out += [f"## {section}", ""]
        intro = _section_intro(cls)
        if intro:
            out += [intro, ""]
        section_hints = typing.get_type_hints(cls)
        comments = field_comments(cls)
        for name, f in config_fields(cls).items():
            head = f"- **`{section}.{name}`**: {type_text(section_hints[name])}; default {default_text(f)}."
            meaning = comments.get(name, "")
            if meaning and meaning[-1] not in ".:!?)":
                meaning += "."
            # A backslash ends the line (a hard break that survives editors trimming spaces).
            out += [head + ("\\" if meaning else "")] + textwrap.wrap(meaning, 100, initial_indent="  ",
                                                                       subsequent_indent="  ")
        out.append("")
        if section == "model":
            out += _model_presets()
        if section == "launch":
            out += _node_presets()
    return "\n".join(out).rstrip() + "\n"


def _model_presets() -> list[str]:
    dims = list(next(iter(MODEL_PRESETS.values())))
    rows = ["The presets of `model.size` (a dimension set beside `size` overrides the preset's):", "",
            "| size | " + " | ".join(dims) + " |", "|---" * (len(dims) + 1) + "|"]
    for size, preset in MODEL_PRESETS.items():
        rows.append(f"| `{size}` | " + " | ".join(_yaml(preset[d]) for d in dims) + " |")
    return rows + [""]


def _node_presets() -> list[str]:
    rows = ["The node types of `launch.preset`:", ""]
    for name, preset in NODE_PRESETS.items():
        env = ", ".join(f"`{k}={v}`" for k, v in preset.env)
        rows.append(f"- `{name}`: {preset.what}; {preset.gpus} GPUs and {preset.cores} cores a node; "
                    f"exports {env}.")
    return rows + [""]


def stale_diff(page: Path = PAGE) -> str:
    """A unified diff from the page on disk to what it should hold; empty when fresh."""
    current = page.read_text() if page.exists() else ""
    return "".join(difflib.unified_diff(current.splitlines(True), render().splitlines(True),
                                        f"{page.name} (on disk)", f"{page.name} (from the schema)"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 with a diff if the page is stale")
    ap.add_argument("--out", type=Path, default=PAGE, help="where the page goes (default: docs/config.md)")
    args = ap.parse_args(argv)
    if args.check:
        diff = stale_diff(args.out)
        sys.stdout.write(diff)
        if diff:
            print(f"{args.out} is stale: run `{COMMAND}`", file=sys.stderr)
        return 1 if diff else 0
    from common.fs import write_atomic

    write_atomic(args.out, render())
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
