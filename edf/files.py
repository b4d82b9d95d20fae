"""EDF files: the environment as TOML and back, base environments, EDF_PATH. parse_edf undoes
render_edf, and `render_edf(parse_edf(text))` is `text`'s canonical form: annotations as nested
tables (`[annotations.com.hooks.aws_ofi_nccl]`), which the EDF reference declares equivalent to the
dotted keys people write by hand; both are read.
"""

from __future__ import annotations

import contextlib
import os
import re
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional, Union

import tomli_w

from edf.environment import Environment, Expansion, Mount, check_edf_name, is_local_image, split_expansions
from common.errors import UNPRINTABLE, ConfigError, bounded, bounded_path, shown, warn
from common.secrets import file_findings, flag_variable
from common.yaml import MAX_DEPTH, read_text_bounded
from common.fs import write_atomic

TOP_KEYS = ("base_environment", "image", "workdir", "entrypoint", "writable", "mounts", "env", "annotations")
MAX_BASE_DEPTH = 10  # "Supports up to 10 levels of recursion" (EDF reference)


# ---------------------------------------------------------------- Render and parse


def render_edf(env: Environment) -> str:
    """The EDF for `env`, unspecified keys left out. `mount_home` (pyxis only) is not part of it."""
    env.check()
    doc = {  # None, and an empty list or table, is "not specified"
        "base_environment": list(env.base_environment) or None,
        "image": env.image or None,
        "workdir": env.workdir,
        "entrypoint": env.entrypoint,
        "writable": env.writable,
        "mounts": [m.spec() for m in env.mounts] or None,
        # env_from_host as a reference the Container Engine expands from srun's environment:
        # the name is written, never the value.
        "env": {**env.env, **{name: f"${{{name}}}" for name in env.env_from_host}} or None,
        "annotations": _nest(env.annotations) or None,
    }
    # tomli-w escapes the C0 controls in a value (a tab aside); the others one_line escapes (C1,
    # bidirectional, line separators) too, as \uXXXX: an editor or a terminal showing the file would act on them.
    return UNPRINTABLE.sub(lambda m: m[0] if m[0] in "\n\t" else f"\\u{ord(m[0]):04x}",
                           tomli_w.dumps({key: value for key, value in doc.items() if value is not None}))


def _nest(flat: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def parse_edf(source: Union[str, os.PathLike]) -> Environment:
    """An EDF back into the model, validated: `source` is a path (a `Path`, or a one-line string
    without '=') or the TOML text itself. Errors name the file (if any) and the key."""
    path: Optional[Path] = None
    if isinstance(source, os.PathLike) or ("\n" not in source and "=" not in source and source.strip()):
        path = Path(source)
        text = _read(path, "no such EDF file: check the path, or pass the TOML text itself")
    else:
        text = str(source)
    env, problems = _from_document(load_toml(text, str(path) if path else "EDF"), path)
    if problems:
        raise problems[0]
    return env


def _read(path: Path, missing: str) -> str:
    try:
        return read_text_bounded(path, str(path))
    except FileNotFoundError:
        raise ConfigError(str(path), missing) from None
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read this EDF: {exc.strerror or exc}") from None


def load_toml(text: str, where: str) -> dict[str, Any]:
    """An EDF's TOML table, refused when deeper than any EDF (an EDF is a few flat keys and one level
    of tables; annotations nest a few levels). Its size was bounded as its file was read."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(where, f"not valid TOML: {bounded(str(exc), 200)}") from None
    except RecursionError:
        doc = None
    if doc is None or _depth(doc, MAX_DEPTH) > MAX_DEPTH:
        raise ConfigError(where, f"tables or arrays nested deeper than {MAX_DEPTH} levels: no EDF key takes that; "
                                 "flatten it")
    return doc


def _depth(value: Any, limit: int) -> int:
    """How deeply `value` nests tables and arrays, counting no further than `limit` + 1."""
    if limit < 0 or not isinstance(value, (dict, list)):
        return 0
    items = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(v, limit - 1) for v in items), default=0)


def _from_document(doc: dict[str, Any], path: Optional[Path]) -> tuple[Environment, list[ConfigError]]:
    """The model from every well-typed key of a parsed EDF table (of file `path`), and every problem in it."""
    origin = f"{path}:" if path else ""
    problems = [ConfigError(f"{origin}{key}", f"unknown EDF key; valid keys: {', '.join(TOP_KEYS)}")
                for key in doc if key not in TOP_KEYS]

    def get(key: str, types: tuple[type, ...], expected: str) -> Any:
        value = doc.get(key)
        if value is not None and not isinstance(value, types):
            problems.append(ConfigError(f"{origin}{key}", f"expected {expected}, got {shown(value)}"))
            return None
        return value

    def strings(items: list[tuple[Any, Any]], where: Callable[[Any], str], expected: str = "a string") -> dict:
        problems.extend(ConfigError(where(k), f"expected {expected}, got {shown(v)}") for k, v in items
                        if not isinstance(v, str))
        return {k: v for k, v in items if isinstance(v, str)}

    base = get("base_environment", (str, list), "a string or an array of strings")
    bases = strings(list(enumerate([base] if isinstance(base, str) and base else base or [])),
                    lambda i: f"{origin}base_environment[{i}]")
    mounts = []
    for i, text in enumerate(get("mounts", (list,), 'an array of "SRC:DST[:FLAGS]" strings') or []):
        try:
            mounts.append(Mount.parse(text, f"{origin}mounts[{i}]"))
        except ConfigError as exc:
            problems.append(exc)
    env_table = strings(list((get("env", (dict,), "a table of strings") or {}).items()),
                        lambda key: f"{origin}env.{key}", 'a string ("" unsets the variable)')
    annotations: dict[str, str] = {}
    _flatten(get("annotations", (dict,), "a table") or {}, f"{origin}annotations", "", annotations, problems)
    env = Environment(
        image=get("image", (str,), "a string") or "",
        mounts=mounts,
        workdir=get("workdir", (str,), "a string"),
        writable=get("writable", (bool,), "true or false"),
        env=env_table,
        annotations=annotations,
        entrypoint=get("entrypoint", (bool,), "true or false"),
        base_environment=list(bases.values()),
        origin=origin,
        source=path,
    )
    # The model's own rules on what parsed (a mount it refused is not in it, so never told twice).
    return env, problems + env.problems()


def check_edf(source: Union[str, os.PathLike], *,
              notes: Optional[list[str]] = None) -> tuple[Optional[Environment], list[ConfigError]]:
    """`slipway edf --check FILE`: (its model, or None if unreadable; every problem in it and its bases).
    With `notes` (a list to fill), its host paths must exist here too (`missing_host_paths`)."""
    path = Path(source)
    try:
        text = _read(path, "no such EDF file: check the path")
        doc = load_toml(text, str(path))
    except ConfigError as exc:
        return None, [exc]
    env, problems = _from_document(doc, path)
    for line in secret_lines(text, str(path)):
        warn(line)
    resolved = env
    if not problems and env.base_environment:
        try:
            resolved = resolve_base(env)
        except ConfigError as exc:
            problems.append(exc)
    if notes is not None and not problems:
        problems += missing_host_paths(resolved, f"{path}:", notes)
    return env, problems


def secret_lines(text: str, where: str) -> list[str]:
    """A hand-written EDF's lines that detect-secrets' scan finds a secret on: the file is the user's,
    so they are warned of by line, never by value, and not refused."""
    lines, out = text.splitlines(), {}
    for found in file_findings(text.encode(), "edf.toml"):  # one line, once: the first plugin's word for it
        key = re.match(r"""\s*["']?([\w.-]*)""", lines[found.line_number - 1]).group(1)  # type: ignore[union-attr]
        variable = flag_variable(key.rsplit(".", 1)[-1]) if key else "NAME"
        out.setdefault(found.line_number, f"{where} line {found.line_number} holds what looks like a secret "
                                          f"({found.type}): whoever reads the file reads it, and under pyxis it is "
                                          f"written into the batch script; write \"${{{variable}}}\" and export "
                                          f"{variable} in the shell that runs srun instead")
    return list(out.values())


def missing_host_paths(env: Environment, origin: str, notes: list[str]) -> list[ConfigError]:
    """The image file and mount sources of `env` that do not exist here (srun would fail on them); a
    path with an unset `${VAR}` cannot be judged here and is noted."""
    problems: list[ConfigError] = []
    paths = [(f"{origin}image", "image file", env.image)] if env.image and is_local_image(env.image) else []
    paths += [(f"{origin}mounts[{i}]", "mount source", m.src) for i, m in enumerate(env.mounts)]
    for where, what, value in paths:
        host = _expanded_here(value, where)
        if isinstance(host, Expansion):
            notes.append(f"{where}: cannot judge {what} {bounded_path(value)!r} from here: ${{{host.name}}} is not set "
                         "in this shell (export it to check the path)")
            continue
        try:
            exists = Path(host).exists()
        except (OSError, ValueError) as exc:  # a name too long for this filesystem, a NUL
            problems.append(ConfigError(where, f"{what} {bounded_path(host)!r} is not a usable path "
                                               f"({getattr(exc, 'strerror', None) or exc}): fix the path"))
            continue
        if not exists:
            shown = repr(bounded_path(host)) + ("" if host == value else f" (from {bounded_path(value)!r})")
            problems.append(ConfigError(where, f"{what} {shown} does not exist on this machine: create it or fix "
                                               "the path (srun would fail to start the container)"))
    return problems


def _expanded_here(value: str, where: str) -> Union[str, Expansion]:
    """`value` with `${VAR}` from this environment (else its default), or the first it cannot resolve."""
    out = []
    for piece in split_expansions(value, where):
        if not isinstance(piece, Expansion):
            out.append(piece)
        elif piece.name in os.environ:
            out.append(os.environ[piece.name])
        elif ":-" in piece.text:
            out.append(piece.text[len(piece.name) + 4: -1])
        else:
            return piece
    return "".join(out)


def _flatten(table: dict[str, Any], where: str, prefix: str, out: dict[str, str],
             problems: list[ConfigError]) -> None:
    for key, value in table.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict):
            _flatten(value, where, f"{full}.", out, problems)
        elif isinstance(value, str):
            out[full] = value
        else:
            problems.append(ConfigError(f"{where}.{full}", f'expected a string such as "true", got {shown(value)}'))


# ---------------------------------------------------------------- EDF_PATH and base environments


def edf_search_path(edf_path: Optional[str] = None) -> list[Path]:
    """The EDF search directories: `edf_path` or $EDF_PATH (colon-separated), default ~/.edf."""
    value = os.environ.get("EDF_PATH") if edf_path is None else str(edf_path)
    dirs = []
    for entry in (value or "").split(":"):
        if not entry:
            continue
        if not os.path.isabs(entry):
            raise ConfigError("EDF_PATH", f"entry {entry!r} is not absolute: the Container Engine takes only "
                                          "absolute directories in EDF_PATH")
        dirs.append(Path(entry))
    return dirs or [Path.home() / ".edf"]


def expand_host(value: str, where: str) -> str:
    """`value` with `${VAR}` taken from the host environment, as the Container Engine does."""
    expanded = _expanded_here(value, where)
    if isinstance(expanded, Expansion):
        raise ConfigError(where, f"${{{expanded.name}}} is not set in this environment: export it, or write "
                                 f"${{{expanded.name}:-}} for an empty default")
    return expanded


def find_edf(entry: str, where: str = "environment", edf_path: Optional[str] = None) -> Path:
    """The file `srun --environment=ENTRY` would use: a path, or NAME.toml in EDF_PATH."""
    name = expand_host(entry, where)
    if "/" in name:
        path = Path(name)
        if not path.is_file():
            raise ConfigError(where, f"no EDF file {str(path)!r} (relative paths start from {os.getcwd()!r})")
        return path
    dirs = edf_search_path(edf_path)
    for directory in dirs:
        candidate = directory / f"{name}.toml"
        if candidate.is_file():
            return candidate
    raise ConfigError(where, f"no EDF named {name!r} ({name}.toml) in EDF_PATH {':'.join(map(str, dirs))!r}: "
                             "install it with slipway edf CONFIG --install (the config whose environment it is) "
                             "or give a path")


def resolve_base(env: Environment, edf_path: Optional[str] = None) -> Environment:
    """`env` with its `base_environment` chain merged as the Container Engine does: bases in order,
    then `env`; a later scalar wins, later mounts and env entries are appended."""
    stack = (env.source.resolve(),) if env.source is not None else ()
    return _resolve(env, edf_path, stack, 0)


def _resolve(env: Environment, edf_path: Optional[str], stack: tuple[Path, ...], depth: int) -> Environment:
    if not env.base_environment:
        return env
    merged = Environment()
    for i, entry in enumerate(env.base_environment):
        where = f"{env.origin}base_environment[{i}]"
        path = find_edf(entry, where, edf_path)
        real = path.resolve()
        if real in stack:
            chain = " -> ".join(p.name for p in (*stack[stack.index(real):], real))
            raise ConfigError(where, f"base_environment cycle {chain}: remove one of these references")
        if depth >= MAX_BASE_DEPTH:
            raise ConfigError(where, f"base environments nest deeper than {MAX_BASE_DEPTH} levels (the Container "
                                     "Engine's limit): flatten the chain")
        merged = _merge(merged, _resolve(parse_edf(path), edf_path, (*stack, real), depth + 1))
    result = _merge(merged, replace(env, base_environment=[]))
    result.origin, result.source = env.origin, env.source
    result.check()  # [env] entries may now refer to entries from a base
    return result


def _merge(base: Environment, child: Environment) -> Environment:
    # A child's entry, by value or from the host, replaces the base's of the same name (placed as the child's).
    from_host = [n for n in base.env_from_host if n not in child.env]
    from_host += [n for n in child.env_from_host if n not in from_host]
    return replace(  # the child's runtime, edf_name and keep_builds
        child,
        image=child.image or base.image,
        mounts=base.mounts + [m for m in child.mounts if m not in base.mounts],
        env={**{k: v for k, v in base.env.items() if k not in child.env and k not in child.env_from_host}, **child.env},
        env_from_host=from_host,
        annotations={**base.annotations, **child.annotations},
        base_environment=[],
        **{name: getattr(base, name) if getattr(child, name) is None else getattr(child, name)
           for name in ("workdir", "writable", "entrypoint", "mount_home")},
    )


# ---------------------------------------------------------------- Writing


def write_edf(env: Environment, path: Union[str, os.PathLike], force: bool = False) -> Path:
    """Write `render_edf(env)` to `path` atomically; different content there is refused unless `force`."""
    path = Path(path)
    text = render_edf(env)
    if path.is_dir():
        raise ConfigError(str(path), "is a directory: give the EDF file's path, e.g. env.toml")
    if path.exists():
        with contextlib.suppress(OSError, UnicodeDecodeError):  # unreadable: different
            if path.read_text(encoding="utf-8") == text:
                return path
        if not force:
            raise ConfigError(str(path), "already exists with different content: pass --force to overwrite it")
    return write_atomic(path, text)  # its directory made where missing


def install_edf(env: Environment, name: str, edf_path: Optional[str] = None, force: bool = False) -> Path:
    """Write the EDF as NAME.toml into the first EDF_PATH directory, where `srun --environment=NAME` finds it."""
    check_edf_name(name, "container.edf_name")
    return write_edf(env, edf_search_path(edf_path)[0] / f"{name}.toml", force=force)
