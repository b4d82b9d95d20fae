"""The environment as `srun` flags (`srun_flags`), for every way into the container (the batch script,
`slipway shell`, a preparation job). pyxis has no EDF (NVIDIA/pyxis README, args.c): the environment
becomes its flags, and `[env]` variables the batch script exports, named in `--container-env=` so that
pyxis keeps them over the image's as the Container Engine does. Every string returned is shell text
where only `${NAME}` and `${NAME:-default}` expand: quote it with `jobs.slurm.ranks.shell_value`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from edf.environment import EXPANSION, SQSH, Environment, Expansion, is_local_image, references, split_expansions
from edf.files import expand_host, resolve_base
from common.errors import ConfigError, shown

ENTRYPOINT_LOG = "com.pyxis.entrypoint_log"


@dataclass(frozen=True)
class SrunFlags:
    """What one `srun` needs to run its tasks in the container, in EDF text."""

    args: list[str] = field(default_factory=list)  # --environment=, or the --container-* flags in order
    exports: list[tuple[str, str]] = field(default_factory=list)  # (NAME, value) set for the srun alone
    warnings: list[str] = field(default_factory=list)  # what the runtime cannot do as the EDF would

    def expanded(self) -> tuple[list[str], dict[str, str]]:
        """(args, exports) with `${VAR}` from this process's environment, for an srun without a shell."""
        args = [expand_host(a, "container") for a in self.args]
        return args, {name: expand_host(value, f"container.env.{name}") for name, value in self.exports}


def srun_flags(env: Environment, edf_file: Optional[Path] = None) -> SrunFlags:
    """The srun flags for `env` by its runtime: `--environment=EDF_FILE` (absolute, so that srun never
    searches EDF_PATH for it), the pyxis flags, or none."""
    if env.runtime == "edf":
        if edf_file is None or not Path(edf_file).is_absolute():
            raise ValueError(f"runtime edf needs the absolute path of the EDF file, got {edf_file!r}")
        return SrunFlags([f"--environment={edf_file}"])
    if env.runtime == "pyxis":
        return to_pyxis_args(env)
    return SrunFlags()


def to_pyxis_args(env: Environment) -> SrunFlags:
    """The pyxis flags for `env`, its bases resolved; what it leaves unspecified gets the Container
    Engine's default explicitly, so that both runtimes behave alike whatever the site's pyxis settings."""
    if env.base_environment:
        env = resolve_base(env)
    env.check()
    w = env.origin
    if not env.image:
        raise ConfigError(f"{w}image", "pyxis needs an image: a squashfs path (absolute or ./) or a registry "
                                       "reference such as nvcr.io#nvidia/pytorch:25.01-py3")
    args = [f"--container-image={to_shell(pyxis_image(env.image), f'{w}image')}"]
    if env.mounts:
        args.append("--container-mounts=" + ",".join(_mount(env, i) for i in range(len(env.mounts))))
    if env.workdir is not None:
        args.append(f"--container-workdir={to_shell(env.workdir, f'{w}workdir')}")
    args.append("--container-readonly" if env.writable is False else "--container-writable")
    exports, warnings = _exports(env)
    names = [name for name, _ in exports] + passed_from_host(env)
    if names:
        args.append("--container-env=" + ",".join(names))
    args.append("--container-mount-home" if env.mount_home else "--no-container-mount-home")
    args.append("--container-entrypoint" if env.entrypoint else "--no-container-entrypoint")
    for key, value in env.annotations.items():
        if key != ENTRYPOINT_LOG or value not in ("true", "false"):
            warnings.append(f"{w}annotations.{key} = {shown(value, key)} has no pyxis equivalent and is dropped "
                            "(only the Container Engine runs its hooks)")
        elif value == "true":
            args.append("--container-entrypoint-log")
    return SrunFlags(args, exports, warnings)


def pyxis_image(image: str) -> str:
    """The image in enroot's `[USER@][REGISTRY#]IMAGE[:TAG]` form: enroot (so pyxis) reads CSCS's
    `nvcr.io/nvidia/pytorch:25.11-py3` as a Docker Hub image, so a registry host (a first part with '.'
    or ':', or `localhost`) is set off with '#'. A squashfs path, or a registry from a `${VAR}`, stays."""
    expansion, slash = image.find("${"), image.find("/")
    if is_local_image(image) or expansion != -1 and (slash == -1 or expansion < slash):
        return image
    user, at, head = image.rpartition("@")
    if "#" in head or "/" not in head:
        return image
    first, rest = head.split("/", 1)
    if "." in first or ":" in first or first == "localhost":
        return f"{user}{at}{first}#{rest}"
    return image


def _mount(env: Environment, i: int) -> str:
    where, mount = f"{env.origin}mounts[{i}]", env.mounts[i]
    if SQSH in mount.flags:
        raise ConfigError(where, f"pyxis cannot mount a squashfs file ({mount.spec()!r} has flag sqsh): "
                                 "use container.runtime edf, or mount the directory it was made from")
    spec = mount.spec()
    if "," in spec:
        raise ConfigError(where, f"{spec!r} contains ',', which separates pyxis mounts: mount a parent "
                                 "directory without ',' in its path")
    return to_shell(spec, where)


def passed_from_host(env: Environment) -> list[str]:
    """The variables pyxis takes from srun's environment by name: `env_from_host`'s, and `[env]`'s
    `NAME = "${NAME}"`. No value of theirs reaches the batch script's text or its trace."""
    return [key for key, value in env.env.items() if value == f"${{{key}}}"] + list(env.env_from_host)


def _exports(env: Environment) -> tuple[list[tuple[str, str]], list[str]]:
    exports, warnings = [], []
    passed = set(passed_from_host(env))
    for key, value in env.env.items():
        where = f"{env.origin}env.{key}"
        if key in passed:
            continue
        if "\n" in value:
            raise ConfigError(where, f"value {shown(value, where)} contains a newline, which pyxis cannot receive through the "
                                     "batch script: use container.runtime edf, or drop the newline")
        exports.append((key, to_shell(value, where)))
        if value == "":
            warnings.append(f"{where} is empty: the Container Engine unsets it, pyxis sets it to an empty string")
        refs = references(value, where)
        if refs:
            warnings.append(f"{where} uses {', '.join(f'${{{r}}}' for r in refs)}: pyxis takes it from the batch "
                            "script's environment, the Container Engine from the image's environment first")
    return exports, warnings


def to_shell(value: str, where: str) -> str:
    """EDF text as shell text: `$$` becomes `$`; `${NAME}` stays an expansion. A literal `${`
    (`$${` in an EDF) would be one in the batch script, so it is an error here."""
    text, spans = "", []
    for piece in split_expansions(value, where):
        if isinstance(piece, Expansion):
            spans.append((len(text), piece.text))
        text += piece.text if isinstance(piece, Expansion) else piece
    if spans != [(m.start(), m.group()) for m in EXPANSION.finditer(text)]:
        raise ConfigError(where, f"{shown(value, where)} holds a literal '${{' (written $${{), which the batch script would "
                                 "expand: pyxis cannot pass it; use container.runtime edf")
    return text
