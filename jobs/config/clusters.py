"""Cluster profiles: where a config runs (`--cluster NAME`, or $SLIPWAY_CLUSTER).

A config says what to train; a profile says where (account, partition, runtime, node preset,
mounts, image store ...), in the config's own sections (slurm, container, launch, image), plus what
only a cluster knows (`cluster:`). Profiles live in `clusters.yaml` at the project's root and in
`${XDG_CONFIG_HOME:-~/.config}/slipway/clusters.yaml`, each a map from a cluster's name to its
profile; a name in both is merged key by key, the project's value winning.

Precedence: the config < the profile < the command line. The profile names where the run goes, so
it wins over a config written for another cluster; what the user types for this one command wins
over both. The profile is merged into the config's YAML tree before the overrides, and the tree is
then read once, whole (`load_config`): every check between fields sees the values that will run.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from common.errors import ConfigError, bounded_path, shown
from common.fs import NotRegularFile, read_file
from common.schema import from_dict, part_of, require, to_dict, unknown_key
from common.yaml import MAX_TEXT, at_line, read_yaml
from containers.record import ImageSection
from edf.environment import SAFE_NAME, Environment
from jobs.config.sections import LaunchSection, SlurmSection

# The config's sections a profile may set: where a run goes, never what it trains.
SECTIONS: dict[str, type] = {"slurm": SlurmSection, "container": Environment, "launch": LaunchSection,
                             "image": ImageSection}
ENV = "SLIPWAY_CLUSTER"
FILE = "clusters.yaml"
# The cluster whose bad nodes a submission without a profile remembers (jobs/slurm/bad_nodes.py).
DEFAULT = "default"
DAY = 86400


@dataclass
class ClusterSection:
    """What only a cluster knows, beside the config's sections (a profile's `cluster:`)."""

    # Seconds a node blamed by a job of this cluster (a failed preflight, a hang, a node that died)
    # stays excluded from its later jobs, unless a clean preflight on it clears it first or
    # `slipway nodes --forget NODE` does; 0: remember none.
    forget_bad_nodes_after: int = DAY
    # The directory `slipway edf --install` writes EDFs into (the Container Engine's EDF_PATH
    # there); null: $EDF_PATH's first directory, else ~/.edf. `slipway doctor --cluster` checks
    # that it is writable.
    edf_dir: Optional[str] = None

    def check(self, where: str) -> None:
        require(0 <= self.forget_bad_nodes_after <= 365 * DAY, f"{where}.forget_bad_nodes_after",
                f"must be between 0 (remember none) and {365 * DAY} seconds, got {self.forget_bad_nodes_after}")
        require(self.edf_dir is None or (os.path.isabs(self.edf_dir) and "\n" not in self.edf_dir
                                         and ":" not in self.edf_dir), f"{where}.edf_dir",
                f"must be one absolute directory (as EDF_PATH takes them), got {shown(self.edf_dir)}")


KEYS = (*SECTIONS, "cluster")


@dataclass(frozen=True)
class ClusterProfile:
    """One cluster's profile, merged from the files that name it."""

    name: str
    settings: dict = field(default_factory=dict)  # config section -> key -> value, as written (merged)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    sources: tuple[str, ...] = ()  # the files it came from, the user's first

    def record(self) -> dict:
        """What the manifest keeps of it: the run's directory alone says where it ran, and how."""
        return {"name": self.name, "sources": list(self.sources), "settings": to_dict(self.settings),
                "cluster": to_dict(self.cluster)}

    def sets(self, dotted: str) -> bool:
        """Whether the profile sets config key `dotted` (a section.key[...] path)."""
        section, _, rest = dotted.partition(".")
        key = rest.split(".", 1)[0].split("[", 1)[0]
        return isinstance(self.settings.get(section), dict) and key in self.settings[section]

    @property
    def where(self) -> str:
        return f"cluster profile {self.name} ({', '.join(self.sources)})"


def profile_files(project_dir: Path) -> list[Path]:
    """Where profiles are read from, the one that wins last: the user's, then the project's."""
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".config"  # empty or relative: unset (XDG spec)
    return [base / "slipway" / FILE, Path(project_dir) / FILE]


def selected(given: Optional[str]) -> tuple[Optional[str], str]:
    """The cluster a command is for, and where that was said: `--cluster`, else $SLIPWAY_CLUSTER
    (environment input, checked like a config value); (None, "") for none."""
    name, where = (given, "--cluster") if given is not None else (os.environ.get(ENV) or None, f"${ENV}")
    if name is None:
        return None, ""
    if not SAFE_NAME.fullmatch(name):
        fix = "unset it, or export a cluster's name" if where != "--cluster" else "give a cluster's name"
        raise ConfigError(where, f"{shown(name)} is not a cluster name (1-100 letters, digits, '.', '_' or '-', "
                                 f"starting with a letter or digit): {fix} from {FILE}")
    return name, where


def _read(path: Path) -> dict[str, Any]:
    """The profiles of one file ({} when there is none), each name checked; a file that is no
    regular file, too large, not YAML or not a map of names to maps is one line naming it."""
    shown_path = bounded_path(path)
    try:
        if (found := read_file(path, MAX_TEXT)) is None:
            return {}
    except NotRegularFile as exc:
        raise ConfigError(shown_path, f"{exc.strerror}: {FILE} must be a YAML file of cluster profiles") from None
    except OSError as exc:
        raise ConfigError(shown_path, f"cannot be read ({exc.strerror or exc}): fix its permissions or move it "
                                      "aside") from None
    if found[0] is None:
        raise ConfigError(shown_path, f"larger than {MAX_TEXT} bytes, more than any profiles need: check that "
                                      "this is the file you meant")
    try:
        text = found[0].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(shown_path, f"is not UTF-8 text (byte {exc.start}): save it as UTF-8") from None
    raw = read_yaml(text, shown_path)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(shown_path, "must map cluster names to profiles, e.g. `alps: {slurm: {account: a-g1}}`")
    for name, profile in raw.items():
        require(bool(SAFE_NAME.fullmatch(name)), f"{shown_path} {shown(name)}",
                "is not a cluster name: use 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit")
        if profile is not None and not isinstance(profile, dict):
            raise ConfigError(f"{shown_path} {name}", f"expected a profile (a mapping of sections: "
                                                      f"{', '.join(KEYS)}), got {shown(profile)}")
    return raw


def _checked(profile: Optional[dict], where: str) -> dict:
    """One file's profile, every key and value read by the config's own rules."""
    profile = profile or {}
    for key, part in profile.items():
        if key not in KEYS:
            raise unknown_key(key, list(KEYS), where, "a cluster profile")
        if key == "cluster":
            from_dict(ClusterSection, part, f"{where}.cluster")
        else:
            part_of(SECTIONS[key], part, f"{where}.{key}")
    return profile


def merged(base: dict, top: dict) -> dict:
    """`base` with `top`'s values over it, mapping by mapping (a list or a value is replaced whole)."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def find_profile(name: str, project_dir: Path, where: str = "--cluster") -> ClusterProfile:
    """The profile named `name`, read and checked; one line listing the known clusters where none is."""
    files = [(path, _read(path)) for path in profile_files(project_dir)]
    found = [(path, profiles[name]) for path, profiles in files if name in profiles]
    if not found:
        names = sorted({n for _, profiles in files for n in profiles})
        looked = " or ".join(bounded_path(p) for p, _ in files)
        listing = f"known clusters: {', '.join(names)}" if names else \
            f"no profile is written yet: add one to {bounded_path(files[-1][0])} (docs/clusters.md#cluster-profiles)"
        raise ConfigError(where, f"no cluster {shown(name)} in {looked}; {listing}")
    settings: dict = {}
    for path, profile in found:
        try:
            settings = merged(settings, _checked(profile, f"{bounded_path(path)} {name}"))
        except ConfigError as exc:  # the file named once (in the field), the line beside it: "FILE KEY: line N: ..."
            raise at_line(exc, path, exc.field.rsplit(" ", 1)[-1], named=False) from None
    cluster = from_dict(ClusterSection, settings.pop("cluster", None), f"cluster {name}.cluster")
    return ClusterProfile(name, settings, cluster, tuple(str(p) for p, _ in found))


def resolve(given: Optional[str], project_dir: Path) -> Optional[ClusterProfile]:
    """The profile a command runs with: `--cluster`'s, else $SLIPWAY_CLUSTER's, else none."""
    name, where = selected(given)
    return None if name is None else find_profile(name, project_dir, where)


def key(profile: Optional[ClusterProfile]) -> str:
    """The name a cluster's remembered state goes by: its profile's, else DEFAULT."""
    return profile.name if profile is not None else DEFAULT
