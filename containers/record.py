"""What an image is asked to be (`ImageSection`, in the config tree) and what a build made
(`BuildRecord`: OUTPUT_DIR/NAME-HASH12.json beside each squashfs, and OUTPUT_DIR/NAME.json for the
current one, read back through `BuildRecord.read`, never as a raw dict).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal, Optional

from edf.environment import ENV_NAME
from common.fs import read_json
from common.schema import FREE_TEXT, require
from common.secrets import TEXT


@dataclass
class ImageSection:
    """How `make image` builds the training image (containers/image.py).

    Relative paths are relative to the checkout. The tag is localhost/NAME:HASH12-PROJECT
    (PROJECT the checkout's identity) and the squashfs OUTPUT_DIR/NAME-HASH12.sqsh, HASH a
    hash of the Dockerfile, the build args and the files copied in (the squashfs's with the
    squash options too); OUTPUT_DIR/NAME.sqsh links to the current one.
    """

    # The Dockerfile podman builds.
    dockerfile: str = "containers/Dockerfile"
    # The image it builds FROM (`make image BASE_IMAGE=...` overrides it).
    # Keep in sync with containers/Dockerfile's ARG BASE_IMAGE.
    base_image: str = "nvcr.io/nvidia/pytorch:25.12-py3"
    # The image's name: localhost/NAME:HASH12-PROJECT and OUTPUT_DIR/NAME-HASH12.sqsh.
    name: str = "slipway"
    # Where the squashfs files go.
    output_dir: str = "images"
    # Build flash-attn against the base's torch and CUDA; false for bases without CUDA.
    flash_attn: bool = True
    # Extra `--build-arg`s (e.g. MAX_JOBS, FLASH_ATTN_VERSION, SMOKE); they override slipway's own. A
    # value stays in the image's history: a name or value that looks like a secret's is refused.
    build_args: dict[str, str] = field(default_factory=dict, metadata={"secrets": TEXT, **FREE_TEXT})
    # podman build --network=host (needed on CSCS).
    network_host: bool = False
    # podman build --isolation: chroot where the host's cgroups or rlimits stop podman's OCI
    # runtime (a failed build says so); null: podman's default.
    isolation: Optional[Literal["chroot", "oci", "rootless"]] = None
    # A directory of wheels: pip installs from it alone (--no-index), for nodes without internet.
    wheelhouse: Optional[str] = None
    # ENROOT_SQUASH_OPTIONS for enroot import (RHEL9's mksquashfs has no lzo, enroot's default).
    squash_options: str = "-comp zstd -Xcompression-level 3 -b 1M"
    # compute: build and import inside one srun (podman storage on /dev/shm dies with the job).
    build_on: Literal["local", "compute"] = "local"

    def check(self, where: str) -> None:
        # podman repository names are lowercase; the name also names files in output_dir.
        require(bool(re.fullmatch(r"[a-z0-9][a-z0-9._-]{0,63}", self.name)), f"{where}.name",
                f"{self.name!r} is not a valid image name: use 1-64 lowercase letters, digits, '.', '_' or '-'")
        require(bool(self.base_image), f"{where}.base_image",
                "must name an image, e.g. nvcr.io/nvidia/pytorch:25.12-py3 or localhost/NAME:TAG")
        # Secrets and line breaks (a value's) are refused as the config is read (common/schema.py).
        for key in self.build_args:
            require(bool(ENV_NAME.fullmatch(key)), f"{where}.build_args.{key}",
                    "build arg names are letters, digits and _ (not starting with a digit)")


@dataclass(frozen=True)
class ImageNeeds:
    """What a run needs of its image beyond the trainer, from the config's other sections
    (jobs.config.Config.image_needs): build args of the image, so an image that lacks them is
    not the one the config builds."""

    float8: bool = False  # train.float8: the float8 extra (torchao)
    numactl: bool = False  # a launch that binds each rank to a NUMA node (torchrun --numa-binding)


@dataclass(frozen=True)
class BuildRecord:
    """One image `make image` built: its content hash, where its squashfs is, and what went in."""

    name: str
    hash: str
    tag: str
    squashfs: str  # absolute
    size_bytes: int = 0
    built_at: str = ""
    base_image: Optional[str] = None
    git_commit: Optional[str] = None
    build_args: Optional[dict] = None  # None: a record too old to say
    build_env: dict = field(default_factory=dict)
    squash_options: Optional[str] = None
    inputs: Optional[dict] = None  # what the hash covers, per part (context.content_hashes); None: an older record
    podman_image_id: Optional[str] = None
    enroot_version: Optional[str] = None
    enroot_mount: Optional[bool] = None
    project: Optional[str] = None  # the project that built it (containers/project.py); None: an older record
    cuda: Optional[str] = None  # its ENV CUDA_VERSION (as NGC and nvidia/cuda bases set it); None: unknown
    # The CUDA architectures a compile of flash-attn targets ("90", "80;90;100;120"; a flash-attn kept
    # from the base or a wheel brings its own); None: unknown, or a record from before they were kept.
    flash_attn_archs: Optional[str] = None

    def flash_attn_serves(self, capability: str) -> Optional[bool]:
        """Whether flash-attn's compiled architectures run on a GPU of compute `capability` ("9.0"): a
        cubin runs on its own major at the same or a later minor; None when unknown."""
        if not self.flash_attn_archs:
            return None
        major, _, minor = capability.partition(".")
        archs = [a for a in re.split(r"[;, ]+", self.flash_attn_archs) if re.fullmatch(r"\d{2,3}a?", a)]
        return any(a.rstrip("a")[:-1] == major and int(a.rstrip("a")[-1]) <= int(minor or 0) for a in archs)

    @property
    def hash12(self) -> str:
        return self.hash[:12]

    @classmethod
    def from_json(cls, data: object) -> Optional["BuildRecord"]:
        """The record in a parsed JSON document, or None if it is not one (unknown keys ignored; a
        value of the wrong type, as in a damaged record, leaves its field's default)."""
        if not isinstance(data, dict) or not all(isinstance(data.get(k), str) and data.get(k)
                                                 for k in ("name", "hash", "tag", "squashfs")):
            return None
        known = {f.name for f in fields(cls)}
        kinds = {"build_args": dict, "build_env": dict, "inputs": dict, "size_bytes": int, "project": str}
        return cls(**{k: v for k, v in data.items() if k in known and isinstance(v, kinds.get(k, object))})

    @classmethod
    def read(cls, path: Path) -> Optional["BuildRecord"]:
        return cls.from_json(read_json(path))

    @classmethod
    def beside(cls, squashfs: Path) -> Optional["BuildRecord"]:
        """The record `make image` wrote beside this squashfs (NAME-HASH12.json), if it is one of ours."""
        squashfs = squashfs.resolve()
        record = cls.read(squashfs.with_suffix(".json"))
        return record if record and Path(record.squashfs).resolve() == squashfs else None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"
