"""The build context: exactly which files go into the image, and their hash; assembled from the
list that is hashed, so a file outside it can change neither the image nor its tag. Its layout
(containers/Dockerfile's): src/ (the project's files), wheels/ (image.wheelhouse), buildenv/
(flash-attn's compile settings, MAX_JOBS and NVCC_THREADS: neither hashed nor in podman's cache key).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import time
from pathlib import Path
from typing import Optional

from containers.pip_requirements import toml_loads
from containers.sources import MAX_BYTES, MAX_FILES, Folder, SourceFile, collect, copy_into
from containers.record import ImageSection
from common.errors import ConfigError
from common.fs import file_sha256, read_json, write_atomic

HASH_SCHEME = "slipway-image-v1"
# What goes into the image under src/ (the repository layout, see the Dockerfile).
CONTEXT_FILES = ("pyproject.toml", "README.md", "LICENSE")
CONTEXT_DIRS = ("common", "trainer", "jobs", "edf", "containers", "configs")
WHEEL_SUFFIXES = (".whl", ".tar.gz", ".zip")
# Build args that only label the image: not hashed, so a new commit with the same files reuses the image.
UNHASHED_ARGS = ("GIT_COMMIT",)


def project_root() -> Path:
    """The checkout that holds containers/ (and the Dockerfile's sources)."""
    here = Path(__file__).resolve().parents[1]
    return here if (here / "pyproject.toml").is_file() else Path.cwd()


def build_root(project_dir: Optional[Path], dockerfile: str) -> Path:
    """The checkout an image is built from, for a project: the project itself when it holds the
    Dockerfile the config names (a checkout of slipway, the usual case), else the checkout this
    slipway runs from (a project directory of runs and configs apart from the code)."""
    if project_dir is not None and resolve_path(project_dir, dockerfile).is_file():
        return project_dir.resolve()
    return project_root().resolve()


def resolve_path(root: Path, path: str) -> Path:
    p = Path(os.path.expandvars(os.path.expanduser(path)))
    return p if p.is_absolute() else root / p


def context_files(root: Path, image: "ImageSection") -> list[SourceFile]:
    """The build context's files (`dest` e.g. src/trainer/model.py), sorted: sources.py's, and the wheels."""
    files = [SourceFile(f"src/{name}", root / name) for name in CONTEXT_FILES if (root / name).is_file()]
    files += collect([Folder(root / top, f"src/{top}") for top in CONTEXT_DIRS if (root / top).is_dir()],
                     field_name="image", max_bytes=MAX_BYTES, max_files=MAX_FILES).files
    if image.wheelhouse:
        wheels = resolve_path(root, image.wheelhouse)
        if not wheels.is_dir():
            raise ConfigError("image.wheelhouse", f"{wheels} is not a directory: fill one on a machine with "
                              "internet (`pip download -d DIR ...`) or unset image.wheelhouse")
        files += [SourceFile(f"wheels/{p.name}", p) for p in sorted(wheels.iterdir())
                  if p.is_file() and p.name.endswith(WHEEL_SUFFIXES)]
    return sorted(files, key=lambda f: f.dest)


class HashCache:
    """sha256 of files, remembered by (size, mtime, inode) like git's index, so a no-op build rereads no
    wheelhouse. Entries younger than 2 s are not kept (a same-second edit could go unseen)."""

    def __init__(self, path: Path):
        self.path = path
        self.changed = False
        self.entries: dict[str, list] = read_json(path) or {}

    def digest(self, path: Path) -> str:
        st = path.stat()
        key, stamp = str(path.resolve()), [st.st_size, st.st_mtime_ns, st.st_ino]
        hit = self.entries.get(key)
        if hit and hit[:3] == stamp:
            return hit[3]
        digest = file_sha256(path)
        if time.time_ns() - st.st_mtime_ns > 2_000_000_000:
            self.entries[key] = [*stamp, digest]
            self.changed = True
        return digest

    def save(self) -> None:
        if self.changed and self.path.parent.is_dir():
            self.entries = {k: v for k, v in self.entries.items() if os.path.exists(k)}
            write_atomic(self.path, json.dumps(self.entries))
            self.changed = False


def content_hashes(*, dockerfile: str, build_args: dict[str, str], squash_options: str,
                   files: list[SourceFile], cache: HashCache) -> tuple[str, str, dict]:
    """(the squashfs's hash, the podman tag's, the inputs). The tag's covers only what the Dockerfile's
    steps read: a setting only the import reads (the squash options) re-imports the image built already.
    The inputs (what the hashes cover besides the build args, per part: the Dockerfile, each source
    directory, the wheels) go into the build record, so that a later check can name what changed."""
    squashfs, image = hashlib.sha256(), hashlib.sha256()

    def add(*parts: str, only_squashfs: bool = False) -> None:
        line = ("\0".join(parts) + "\n").encode()
        squashfs.update(line)
        if not only_squashfs:
            image.update(line)

    add(HASH_SCHEME)
    add("dockerfile", dockerfile_digest := hashlib.sha256(dockerfile.encode()).hexdigest())
    for key in sorted(build_args):
        if key not in UNHASHED_ARGS:
            add("arg", key, build_args[key])
    add("squash", squash_options, only_squashfs=True)
    parts: dict[str, "hashlib._Hash"] = {}
    for f in files:  # each entry by its content: its bytes, or a link's target
        link = f.link
        entry = (f.dest, "l" if link is not None else "x" if os.access(f.src, os.X_OK) else "-",
                 "l" + hashlib.sha256(link.encode()).hexdigest() if link is not None else cache.digest(f.src))
        add("file", *entry)
        top, _, rest = f.dest.partition("/")
        part = rest.split("/", 1)[0] + ("/" if "/" in rest else "") if top == "src" else f"{top}/"
        parts.setdefault(part, hashlib.sha256()).update(("\0".join(entry) + "\n").encode())
    return squashfs.hexdigest(), image.hexdigest(), {
        "dockerfile": dockerfile_digest, "sources": {part: h.hexdigest()[:16] for part, h in sorted(parts.items())}}


def materialize_context(files: list[SourceFile], dest: Path, build_env: dict[str, str] | None = None) -> None:
    """Lay the context out under `dest`, with `buildenv/flash-attn.env` holding `build_env` as shell assignments."""
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "wheels").mkdir(parents=True)
    (dest / "buildenv").mkdir()
    env_text = "".join(f"{k}={shlex.quote(v)}\n" for k, v in sorted((build_env or {}).items()))
    (dest / "buildenv" / "flash-attn.env").write_text(env_text)
    sources = [f for f in files if not f.dest.startswith("wheels/")]
    copy_into(sources, dest, file_mode=0o644, exec_mode=0o755, dir_mode=0o755)
    for f in files:
        if f.dest.startswith("wheels/"):  # gigabytes: hard-linked where the filesystem allows
            target = dest / f.dest
            try:
                os.link(f.src, target)
            except OSError:
                shutil.copy2(f.src, target)


def project_version(root: Path) -> str:
    try:
        return str(toml_loads((root / "pyproject.toml").read_text())["project"]["version"])
    except (OSError, KeyError, ValueError):
        return "unknown"
