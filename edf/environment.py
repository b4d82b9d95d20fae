"""The one container environment model, and every rule it must satisfy (those of the CSCS EDF
reference, eth-cscs/cscs-docs `docs/software/container-engine/edf.md`). `Environment` is both the
config's `container:` section and what an EDF file holds. Strings stay in EDF syntax: `${VAR}` and
`${VAR:-default}` are left for the Container Engine (under pyxis, the batch script) to expand, `$$`
is a literal `$`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from common.errors import ConfigError, shown
from common.schema import FREE_TEXT
from common.secrets import EXPANSION, PASSTHROUGH, REFERENCE, refusal

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # names are matched whole (fullmatch)
NOT_A_NAME = "is not a valid environment variable name (letters, digits, _; not starting with a digit)"
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
ANNOTATION_KEY = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
_DOLLAR = re.compile(rf"\$\$|{EXPANSION.pattern}|\$\{{")  # what `split_expansions` reads; a lone `$` is text

# Bind-mount options of enroot's mount helper (NVIDIA/enroot `bin/enroot-mount.c`: pyxis and the
# Container Engine hand them on), plus `sqsh`, the Container Engine's only flag of a squashfs mount.
BIND_FLAGS = frozenset({
    "ro", "rw", "bind", "rbind",
    "private", "rprivate", "shared", "rshared", "slave", "rslave", "unbindable", "runbindable",
    "nosuid", "suid", "nodev", "dev", "noexec", "exec",
    "noatime", "atime", "nodiratime", "diratime", "relatime", "norelatime", "strictatime", "nostrictatime",
    "lazytime", "nolazytime", "sync", "async", "dirsync", "silent", "loud",
    "x-create=dir", "x-create=file", "x-create=auto",
})
SQSH = "sqsh"
MOUNT_FLAGS = BIND_FLAGS | {SQSH}


# ---------------------------------------------------------------- `${VAR}` syntax


@dataclass(frozen=True)
class Expansion:
    """`${NAME}` or `${NAME:-default}` inside a value."""

    name: str
    text: str  # exactly as written


def split_expansions(value: str, where: str) -> list[Union[str, Expansion]]:
    """`value` as literal text (`$$` read as `$`; a lone `$` is text, as in the shell) and expansions."""
    pieces: list[Union[str, Expansion]] = []
    literal, i = "", 0
    for m in _DOLLAR.finditer(value):
        literal += value[i:m.start()]
        i = m.end()
        if m.group() == "$$":
            literal += "$"
        elif m.group(1) is None:  # `${` that starts no valid expansion
            bad = value[m.start(): value.find("}", m.start()) + 1 or len(value)]
            raise ConfigError(where, f"{bad!r} in {shown(value, where)} is not a valid expansion: write ${{NAME}} or "
                                     "${NAME:-default}, or $${ for a literal '${'")
        else:
            pieces += [literal, Expansion(m.group(1), m.group())]
            literal = ""
    return [p for p in [*pieces, literal + value[i:]] if p != ""]


def references(value: str, where: str) -> list[str]:
    """The variable names `value` expands."""
    return [p.name for p in split_expansions(value, where) if isinstance(p, Expansion)]


def _split_outside_braces(text: str, sep: str) -> list[str]:
    """`text.split(sep)`, except inside `${...}` (a default may hold a ':')."""
    parts, current, depth = [], "", 0
    for i, ch in enumerate(text):
        if text.startswith("${", i):
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
        elif ch == sep and not depth:
            parts.append(current)
            current = ""
            continue
        current += ch
    return [*parts, current]


def check_path(value: str, where: str, what: str) -> None:
    """A host or container path: absolute, `./`-relative, or starting with a variable."""
    if not value:
        raise ConfigError(where, f"{what} is empty: give an absolute path or one starting with ./")
    if "\0" in value or "\n" in value:
        raise ConfigError(where, f"{what} {shown(value, where)} contains a newline or NUL: use a plain path")
    if value.startswith(("/", "./", "${")):
        return
    if value.startswith("~"):
        raise ConfigError(where, f"{what} {shown(value, where)} starts with ~, which is not expanded: write ${{HOME}}{value[1:]}")
    fix = "./" + value if value not in (".", "") else "./"
    raise ConfigError(where, f"relative {what} {shown(value, where)} must start with ./ (the Container Engine resolves it "
                             f"against the directory srun runs in): write {fix!r}")


# ---------------------------------------------------------------- The model


@dataclass(frozen=True)
class Mount:
    """One `SRC:DST[:FLAGS]` entry; `SRC` alone means `SRC:SRC`."""

    src: str
    dst: str
    flags: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str, where: str = "mounts") -> "Mount":
        if not isinstance(text, str):
            raise ConfigError(where, f"expected a string SRC[:DST[:FLAGS]], got {shown(text, where)}")
        parts = _split_outside_braces(text, ":")
        if len(parts) > 3:
            raise ConfigError(where, f"{shown(text, where)} has {len(parts)} ':'-separated parts: use SRC[:DST[:FLAGS]] "
                                     "(a path containing ':' cannot be mounted this way)")
        if len(parts) == 3 and not parts[2]:
            raise ConfigError(where, f"{shown(text, where)} ends with an empty FLAGS part: drop the trailing ':' "
                                     "or give flags such as ro or ro+private")
        src, dst = parts[0], parts[1] if len(parts) > 1 else parts[0]
        mount = cls(src, dst, tuple(parts[2].split("+")) if len(parts) == 3 else ())
        mount.check(where)
        return mount

    @classmethod
    def from_config_value(cls, value: Any, where: str) -> "Mount":
        """A config file's mount entry (the schema machinery calls this)."""
        return value if isinstance(value, Mount) else cls.parse(value, where)

    def spec(self) -> str:
        """The documented `SRC:DST[:FLAGS]` text (the short `SRC` is read, never written)."""
        text = f"{self.src}:{self.dst}"
        return f"{text}:{'+'.join(self.flags)}" if self.flags else text

    to_config_value = spec  # how the schema engine (common/schema.py `to_dict`) writes it

    def check(self, where: str) -> None:
        for what, path in (("mount source", self.src), ("mount destination", self.dst)):
            check_path(path, where, what)
            if len(_split_outside_braces(path, ":")) > 1:
                raise ConfigError(where, f"{what} {shown(path, where)} contains ':', which separates SRC:DST:FLAGS: "
                                         "mount a parent directory instead")
            split_expansions(path, where)
        for flag in self.flags:
            if flag not in MOUNT_FLAGS:
                raise ConfigError(where, f"mount flag {flag!r} is not one of {', '.join(sorted(MOUNT_FLAGS))}: "
                                         "join several with '+', e.g. ro+private")
        if SQSH in self.flags and len(self.flags) > 1:
            raise ConfigError(where, f"flag 'sqsh' mounts a squashfs file and must be the only flag, got "
                                     f"{'+'.join(self.flags)!r}: write SRC:DST:sqsh")
        if len(set(self.flags)) != len(self.flags):
            raise ConfigError(where, f"flags {'+'.join(self.flags)!r} repeat a flag: give each once")


NOT_CONFIG = {"config": False}  # fields of the model that a config file does not set


@dataclass
class Environment:
    """A container environment, renderable as an EDF or as pyxis `srun` flags.

    `None` (and `""` for image, empty collections) means "not specified": the
    base environments' value, else the runtime's default, applies. An empty
    image in a config means "what `make image` built for this config", which
    the host resolves at submission (`jobs.runs.container`).
    """

    # How tasks run: in a Container Engine environment (`edf`), through pyxis
    # flags (`pyxis`), or directly on the node (`none`, a venv on a shared filesystem).
    runtime: Literal["edf", "pyxis", "none"] = "edf"
    # A squashfs file (absolute or ./-relative) or a registry reference.
    image: str = ""
    # Bind mounts SRC[:DST[:FLAGS]], flags joined with '+' (ro+private); SRC alone mounts it at the
    # same path. Every path the job needs is added at submission.
    mounts: list[Mount] = field(default_factory=list)
    # The working directory inside the container; null: the runtime's default.
    workdir: Optional[str] = None
    # Whether the container's filesystem is writable; null: the runtime's default (pyxis: writable).
    writable: Optional[bool] = None
    # Values in EDF syntax; "" unsets the variable (Container Engine). A name or value that looks
    # like a secret's is refused, except `NAME: "${NAME}"`: pass secrets with env_from_host.
    env: dict[str, str] = field(default_factory=dict, metadata={"secrets": PASSTHROUGH, **FREE_TEXT})
    # Variables the tasks take from the submitting environment by name, their values never written
    # (secrets: HF_TOKEN, WANDB_API_KEY): `NAME = "${NAME}"` in the EDF, `--container-env=NAME`
    # under pyxis, the job's own environment under runtime none (docs/secrets.md).
    env_from_host: list[str] = field(default_factory=list)
    # Flat dotted keys, e.g. "com.hooks.aws_ofi_nccl.enabled" -> "true". A secret-looking key takes a
    # file's path or one "${VAR}" (expanded as the container starts), never the secret itself.
    annotations: dict[str, str] = field(default_factory=dict, metadata={"secrets": REFERENCE, **FREE_TEXT})
    # Whether the image's entrypoint runs before the command; null: the runtime's default
    # (pyxis: it does not).
    entrypoint: Optional[bool] = None
    # EDFs this one builds on (a name looked up in EDF_PATH, or a path to a .toml file).
    base_environment: list[str] = field(default_factory=list)
    # pyxis only (--[no-]container-mount-home); an EDF mounts ${HOME} through `mounts`.
    mount_home: Optional[bool] = None
    # Name under which `slipway edf --install` puts the EDF in EDF_PATH; default: the run name.
    edf_name: Optional[str] = None
    # pyxis only: how many image builds keep their unpacked container on each node, so that a later
    # job of the same build starts without unpacking the image (the most recently used kept, the
    # rest removed at a job's start, never one a queued or running job uses); 0: every job unpacks
    # its own container and removes it at its end. A kept container keeps what jobs write into its
    # filesystem (set writable: false to forbid that). Needs pyxis's container_scope=global, its
    # default (docs/runs.md).
    keep_builds: int = 3
    # Where errors point: "container." (the config), "" (EDF text) or "FILE:".
    origin: str = field(default="", compare=False, repr=False, metadata=NOT_CONFIG)
    # The file it was read from, if any (relative base paths do not use it:
    # like the Container Engine, they start from the working directory).
    source: Optional[Path] = field(default=None, compare=False, repr=False, metadata=NOT_CONFIG)
    # Its strings are EDF text: `$$` is a literal `$` (the schema engine's secret check reads them so).
    EDF_TEXT = True

    @property
    def in_container(self) -> bool:
        return self.runtime != "none"

    def check(self, where: Optional[str] = None) -> None:
        """Raises the first of `problems()`; `where` (the config section's name) prefixes every error."""
        if where is not None:
            self.origin = f"{where}." if where else ""
        problems = self.problems()
        if problems:
            raise problems[0]

    def problems(self) -> list[ConfigError]:
        """Every broken rule, not only the first (`slipway edf --check` lists them all)."""
        w = self.origin
        found: list[ConfigError] = []

        def run(check, *args) -> None:
            try:
                check(*args)
            except ConfigError as exc:
                found.append(exc)

        if self.edf_name is not None:
            run(check_edf_name, self.edf_name, f"{w}edf_name")
        # Before the runtime none return: under every runtime the names are passed, and a
        # config's values land in config.yaml.
        run(self._check_env_from_host)
        # The secret policy on entries merged from base environments too (pyxis resolves them into
        # the script); a key refused is checked no further (no other check may quote its value).
        secret = set()
        for key, value in self.env.items() if w == "container." else ():
            if (refused := refusal(value, name=key, policy=PASSTHROUGH, edf=True)) is not None:
                found.append(ConfigError(f"{w}env.{key}", refused.message()))
                secret.add(key)
        # Before the runtime none return too: a number's bounds do not depend on the runtime.
        if not 0 <= self.keep_builds <= 100:
            found.append(ConfigError(f"{w}keep_builds", f"expected a whole number from 0 to 100 (image builds kept "
                                                        f"unpacked on each node), got {shown(self.keep_builds)}"))
        if self.runtime == "none" and w == "container.":
            return found  # no container: its settings are not used, so not held to the EDF rules
        if self.runtime == "edf" and self.mount_home is not None and w == "container.":
            found.append(ConfigError(f"{w}mount_home", "is a pyxis flag with no EDF key: add ${HOME} to "
                                                       "container.mounts instead"))
        run(_check_image, self.image, f"{w}image")
        if self.workdir is not None:
            run(_check_workdir, self.workdir, f"{w}workdir")
        for i, mount in enumerate(self.mounts):
            run(mount.check, f"{w}mounts[{i}]")
        for i, base in enumerate(self.base_environment):
            run(_check_base_entry, base, f"{w}base_environment[{i}]")
        for key in self.env:
            if key not in secret:
                run(self._check_env_entry, key)
        for key in self.annotations:
            run(self._check_annotation, key)
        return found

    def _check_env_from_host(self) -> None:
        where = f"{self.origin}env_from_host"
        for i, name in enumerate(self.env_from_host):
            if not ENV_NAME.fullmatch(name):
                raise ConfigError(f"{where}[{i}]", NOT_A_NAME)
            if name in self.env_from_host[:i]:
                raise ConfigError(f"{where}[{i}]", f"{name} is listed twice: list it once")
            if name in self.env:
                raise ConfigError(f"{where}[{i}]", f"{name} is also set in {self.origin}env: keep one (env_from_host "
                                                   "takes the submitting environment's value, never written down)")

    def require_host_env(self, environ: Optional[dict[str, str]] = None) -> None:
        """A one-line error where a variable of `env_from_host` is unset here: the job would start without it."""
        missing = [name for name in self.env_from_host if name not in (os.environ if environ is None else environ)]
        if missing:
            raise ConfigError(f"{self.origin}env_from_host",
                              f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set in this "
                              f"environment, and the job takes {'it' if len(missing) == 1 else 'them'} from there: "
                              f"`export {missing[0]}=...` {'(and the others) ' if len(missing) > 1 else ''}first")

    def _check_env_entry(self, key: str) -> None:
        value, where = self.env[key], f"{self.origin}env.{key}"
        if not ENV_NAME.fullmatch(key):
            raise ConfigError(where, NOT_A_NAME)
        if "\0" in value:
            raise ConfigError(where, f"value {shown(value, where)} contains a NUL byte, which no environment can hold")
        for ref in references(value, where):
            if ref != key and ref in self.env:
                raise ConfigError(where, f"refers to ${{{ref}}}, which is set in [env]; [env] entries can only "
                                         f"use host variables: write {ref}'s value into {key} directly, "
                                         f"or export {ref} before srun instead of setting it in [env]")

    def _check_annotation(self, key: str) -> None:
        value, where = self.annotations[key], f"{self.origin}annotations.{key}"
        if not ANNOTATION_KEY.fullmatch(key):
            raise ConfigError(where, "is not a valid annotation key: use dotted names of letters, digits, "
                                     "'_' and '-', such as com.hooks.aws_ofi_nccl.enabled")
        split_expansions(value, where)
        clash = next((k for k in sorted(self.annotations) if k.startswith(key + ".")), None)
        if clash is not None:
            raise ConfigError(where, f"is both a value and the table holding {clash!r}: keep one of them")


def check_edf_name(name: str, where: str) -> None:
    if not SAFE_NAME.fullmatch(name) or name.endswith(".toml"):
        raise ConfigError(where, f"{name!r} is not a safe EDF name: use 1-100 letters, digits, '.', '_' or '-', "
                                 "starting with a letter or digit, without .toml")


def _check_workdir(workdir: str, where: str) -> None:
    check_path(workdir, where, "workdir")
    split_expansions(workdir, where)


def is_local_image(image: str) -> bool:
    """A squashfs file rather than a registry reference."""
    return image.endswith((".sqsh", ".squashfs")) or image.startswith(("/", "./", "../", "~", "${"))


def _check_image(image: str, where: str) -> None:
    if not image:
        return
    if "\n" in image or "\0" in image:
        raise ConfigError(where, f"{shown(image, where)} contains a newline or NUL: give one image")
    split_expansions(image, where)
    if is_local_image(image):
        if not image.startswith(("/", "./", "${")):
            fix = "${HOME}" + image[1:] if image.startswith("~") else "./" + image
            raise ConfigError(where, f"squashfs path {shown(image, where)} must be absolute or start with ./, otherwise pyxis "
                                     f"and the Container Engine read it as a registry image (pyxis #127): "
                                     f"write {fix!r}")
        return
    if any(c.isspace() for c in image):
        raise ConfigError(where, f"registry reference {shown(image, where)} contains whitespace: use "
                                 "[USER@][REGISTRY#]IMAGE[:TAG] or REGISTRY/IMAGE[:TAG]")


def _check_base_entry(base: str, where: str) -> None:
    if not base:
        raise ConfigError(where, "is empty: give an EDF name from EDF_PATH or a path to a .toml file")
    split_expansions(base, where)
    if "/" in base:
        check_path(base, where, "base environment path")
    elif base.endswith(".toml"):
        raise ConfigError(where, f"{shown(base, where)}: a bare name is looked up as NAME.toml in EDF_PATH, so drop the "
                                 f".toml ({base[:-5]!r}) or give a path ('./{base}')")
