"""An image build's plan: everything a build would do, computed without running podman
(containers/image.py makes it; the build and enroot's import, containers/importer.py, read it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from common.errors import ConfigError
from containers.sources import SourceFile
from containers.project import Project


@dataclass
class ImagePlan:
    name: str
    hash: str  # the squashfs's: names it and its record
    tag: str  # localhost/NAME:IMAGEHASH12-PROJECT: the podman image, which import-only settings do not change
    root: Path
    output_dir: Path
    dockerfile: Path
    files: list[SourceFile]
    build_args: dict[str, str]
    squash_options: str
    squashfs: Path  # OUTPUT_DIR/NAME-HASH12.sqsh
    temp_squashfs: Path  # where enroot writes before the rename
    link: Path  # OUTPUT_DIR/NAME.sqsh -> the current squashfs
    record: Path  # OUTPUT_DIR/NAME.json: the current image
    sidecar: Path  # OUTPUT_DIR/NAME-HASH12.json: this image
    log: Path
    context_dir: Path
    podman_argv: list[str]
    enroot_argv: list[str]
    enroot_env: dict[str, str]
    enroot_mount: bool
    build_env: dict[str, str] = field(default_factory=dict)  # buildenv/flash-attn.env: MAX_JOBS, NVCC_THREADS
    inputs: dict = field(default_factory=dict)  # what the hash covers, per part (containers/context.py content_hashes)
    build_on: str = "local"
    # image.build_on: compute: the config the srun's inner build reads (written by the caller).
    frozen_config: Optional[Path] = None
    # Whose image it is (containers/project.py): None only where the checkout cannot record one,
    # which a plan may read but a build refuses.
    project: Optional[Project] = None
    project_error: Optional[ConfigError] = None

    @property
    def hash12(self) -> str:
        return self.hash[:12]

    @property
    def exists(self) -> bool:
        return self.squashfs.is_file()
