"""The training image: content hash, command lines, atomic import, prune, and a real podman build.

Fast tests run the image code against stand-ins for podman, enroot and srun
(tests/image_standins.py) that record their command lines. The `podman` test
builds containers/Dockerfile for real on a small Debian base made here with
mmdebstrap, installs from a wheelhouse downloaded on the host, and runs the
smoke test inside the build.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from rich.console import Console

from containers import context as ctx
from containers import image as img
from containers.diagnose import FLASH_ATTN_STEP_MARK, STEP_NAMES, diagnose_build
from containers.flash_attn_wheel import Target, pick
from containers.image import (
    ImagePlan,
    build_image,
    current_image,
    image_plan,
    resolve_image,
)
from containers.importer import check_free_space, host_name
from containers.context import context_files
from containers.pip_requirements import EXTRAS, requirement_name, requirements, toml_loads
from containers.prune import prune_images
from containers.storage import check_storage_conf, filesystem_type
from containers.tools import Enroot, Podman, ToolError
from containers.project import Project
from containers.record import BuildRecord
from jobs.cli.image import build, compute_argv
from containers.record import ImageSection
from jobs.config import Config, load_config
from conftest import default_signals
from tests.image_standins import calls, flash_attn_standin_wheel, write_standins
from common.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
TEST_BASE = "localhost/slipway-testbase:py311"
CACHE = REPO / ".cache"


# ---------------------------------------------------------------- fixtures


def copy_sources(root: Path, extra: tuple[str, ...] = ()) -> Path:
    """A snapshot of the repository's image sources (the repository itself may change meanwhile)."""
    root.mkdir()
    for name in ctx.CONTEXT_FILES:
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, root / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for top in (*ctx.CONTEXT_DIRS, *extra):
        shutil.copytree(REPO / top, root / top, ignore=ignore)
    return root


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A copy of the repository's sources, plus files the image must ignore."""
    root = copy_sources(tmp_path / "proj", extra=("tests",))
    (root / "runs" / "r1").mkdir(parents=True)
    (root / "runs" / "r1" / "metrics.jsonl").write_text("{}\n")
    return root


@pytest.fixture(autouse=True)
def no_compile_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """MAX_JOBS / NVCC_THREADS in the caller's environment reach image plans: not in these tests."""
    for key in img.BUILD_ENV_KEYS:
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def fakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """podman, enroot and srun stand-ins first on PATH."""
    bin_dir = write_standins(tmp_path / "bin", "podman", "enroot", "srun")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("FAKE_ENROOT_MOUNT", raising=False)
    monkeypatch.delenv("FAKE_ENROOT_MODE", raising=False)
    monkeypatch.setenv("ENROOT_TEMP_PATH", str(tmp_path))
    return bin_dir


def enroot_containers(bin_dir: Path) -> list[dict]:
    """The podman stand-in's containers named like enroot's import containers."""
    rows = [json.loads(p.read_text()) for p in (bin_dir / "state").glob("ctr-*.json")]
    return [c for c in rows if re.match(Enroot.CONTAINER_FILTER, c["Names"][0])]


def make_cfg(**image) -> Config:
    cfg = Config()
    cfg.image = ImageSection(**image)
    return cfg


def plan_of(root: Path, **image) -> ImagePlan:
    return image_plan(make_cfg(**image), root=root, enroot_mount=False)


# ---------------------------------------------------------------- the context and its hash


def test_context_holds_exactly_the_sources(project: Path, tmp_path: Path):
    (project / "trainer" / "__pycache__").mkdir(exist_ok=True)
    (project / "trainer" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    (project / "trainer" / ".notes.swp").write_text("x")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0-cp311-none-any.whl").write_bytes(b"w")
    (wheels / "index.html").write_text("not a wheel")
    files = context_files(project, ImageSection(wheelhouse=str(wheels)))
    dests = [f.dest for f in files]
    assert dests == sorted(dests)
    assert "src/pyproject.toml" in dests and "src/containers/Dockerfile" in dests
    assert "src/trainer/__init__.py" in dests and "src/configs/tiny_cpu.yaml" in dests
    assert "wheels/torch-2.13.0-cp311-none-any.whl" in dests
    assert not [d for d in dests if d.startswith(("src/tests", "src/runs")) or "__pycache__" in d
                or d.endswith((".pyc", ".swp")) or d == "wheels/index.html"]
    with pytest.raises(ConfigError, match="image.wheelhouse"):
        context_files(project, ImageSection(wheelhouse=str(tmp_path / "missing")))


def test_hash_changes_when_and_only_when_an_input_changes(project: Path, tmp_path: Path):
    base = plan_of(project)
    assert base.hash == plan_of(project).hash  # deterministic
    token = Project.of(project).token
    assert re.fullmatch(rf"localhost/slipway:[0-9a-f]{{12}}-{token}", base.tag)
    assert base.squashfs == project / "images" / f"slipway-{base.hash[:12]}.sqsh"

    # Outside the context: runs/, tests/, caches, byte code, a new commit (GIT_COMMIT is not hashed).
    (project / "runs" / "r1" / "metrics.jsonl").write_text('{"loss": 1}\n')
    (project / "tests" / "test_new.py").write_text("def test(): pass\n")
    (project / "trainer" / "__pycache__").mkdir(exist_ok=True)
    (project / "trainer" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\1")
    (project / "notes.txt").write_text("scratch")
    assert plan_of(project).hash == base.hash
    unhashed = image_plan(make_cfg(build_args={"GIT_COMMIT": "deadbeef"}), root=project, enroot_mount=False)
    assert unhashed.hash == base.hash and unhashed.build_args["GIT_COMMIT"] == "deadbeef"
    # Settings that do not change the image's contents.
    assert plan_of(project, network_host=True, isolation="chroot", build_on="compute").hash == base.hash

    def changed(**image) -> str:
        return plan_of(project, **image).hash

    # The Dockerfile, build args, base image, flash-attn, squash options.
    dockerfile = project / "containers" / "Dockerfile"
    original = dockerfile.read_text()
    dockerfile.write_text(original + "\n# a comment\n")
    assert changed() != base.hash
    dockerfile.write_text(original)
    assert changed() == base.hash
    assert changed(build_args={"FLASH_ATTN_VERSION": "2.8.3"}) != base.hash
    assert changed(build_args={"FLASH_ATTN_CUDA_ARCHS": "80;90"}) != base.hash
    # Compile settings that do not change the image (passed through buildenv/, not as build args).
    assert changed(build_args={"MAX_JOBS": "4", "NVCC_THREADS": "2"}) == base.hash
    assert changed(base_image=TEST_BASE) != base.hash
    assert changed(flash_attn=False) != base.hash
    # Settings only the import reads: another squashfs of the same podman image.
    for import_only in ({"squash_options": "-comp lz4"}, {"output_dir": str(tmp_path / "elsewhere")}):
        other = plan_of(project, **import_only)
        assert other.squashfs != base.squashfs and other.tag == base.tag, import_only
    assert changed(squash_options="-comp lz4") != base.hash
    assert plan_of(project, flash_attn=False).tag != base.tag

    # A copied source file: content, a new file, the executable bit.
    model = project / "trainer" / "config.py"
    text = model.read_text()
    model.write_text(text + "\n# edit\n")
    assert changed() != base.hash
    model.write_text(text)
    assert changed() == base.hash
    (project / "configs" / "new.yaml").write_text("run: {}\n")
    assert changed() != base.hash
    (project / "configs" / "new.yaml").unlink()
    assert changed() == base.hash
    os.chmod(model, 0o755)
    assert changed() != base.hash
    os.chmod(model, 0o644)

    # The wheelhouse is in the context: a new wheel changes the hash.
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "a-1.0-py3-none-any.whl").write_bytes(b"1")
    with_wheels = changed(wheelhouse=str(wheels))
    assert with_wheels != base.hash
    (wheels / "b-1.0-py3-none-any.whl").write_bytes(b"2")
    assert changed(wheelhouse=str(wheels)) != with_wheels


def test_hash_cache_rereads_only_changed_files(tmp_path: Path):
    f = tmp_path / "big.whl"
    f.write_bytes(b"x" * 100)
    old = time.time() - 10
    os.utime(f, (old, old))
    cache = ctx.HashCache(tmp_path / "cache.json")
    first = cache.digest(f)
    cache.save()
    reread = ctx.HashCache(tmp_path / "cache.json")
    assert reread.entries and reread.digest(f) == first
    f.write_bytes(b"y" * 100)  # same size, new mtime
    assert reread.digest(f) != first


# ---------------------------------------------------------------- command lines


def test_plan_command_lines(project: Path, fakes: Path, monkeypatch: pytest.MonkeyPatch):
    cfg = make_cfg(base_image=TEST_BASE, flash_attn=False, network_host=True, isolation="chroot",
                   build_args={"MAX_JOBS": "4"})
    plan = image_plan(cfg, root=project)
    h12 = plan.hash[:12]
    out = project / "images"
    owner = Project.of(project)
    tag = plan.tag
    assert tag.startswith("localhost/slipway:") and tag.endswith(f"-{owner.token}")
    args = ["--build-arg", f"BASE_IMAGE={TEST_BASE}", "--build-arg", "FLASH_ATTN=0", "--build-arg", "WHEELHOUSE=",
            "--build-arg", "WHEELHOUSE_DIGEST=", "--build-arg", f"SLIPWAY_VERSION={ctx.project_version(project)}",
            "--build-arg", "GIT_COMMIT=unknown",
            "--label", f"slipway.project={owner.id}", "--label", f"slipway.project.path={project}"]
    assert plan.podman_argv == ["podman", "build", "-f", str(project / "containers" / "Dockerfile"),
                                "-t", tag, *args, "--network=host", "--isolation=chroot",
                                str(out / f".context-{h12}")]
    # Upstream enroot: no -x mount. ENROOT_SQUASH_OPTIONS from image.squash_options.
    temp = out / f".slipway-{h12}.sqsh.tmp-{host_name()}-{os.getpid()}"
    assert plan.enroot_argv == ["enroot", "import", "-o", str(temp), f"podman://{tag}"]
    assert plan.enroot_env == {"ENROOT_SQUASH_OPTIONS": "-comp zstd -Xcompression-level 3 -b 1M"}
    assert not plan.enroot_mount and plan.frozen_config is None
    assert plan.build_env == {"MAX_JOBS": "4"}  # buildenv/flash-attn.env, not a --build-arg
    # CSCS's enroot lists -x in `enroot import --help`: detected, not assumed.
    monkeypatch.setenv("FAKE_ENROOT_MOUNT", "1")
    cscs = image_plan(cfg, root=project)
    assert cscs.enroot_argv == ["enroot", "import", "-x", "mount", "-o", str(temp), f"podman://{tag}"]
    assert calls(fakes, "enroot")[-1]["argv"] == ["enroot", "import", "--help"]
    # --force rebuilds without the layer cache.
    assert image_plan(cfg, root=project, force=True, enroot_mount=False).podman_argv[-2] == "--no-cache"


def test_compute_build_command_line_and_run(project: Path, fakes: Path):
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml",
                      ["image.build_on=compute", "slurm.partition=debug", "slurm.account=a-07",
                       "slurm.time=00:45:00", f"image.base_image={TEST_BASE}"])
    plan = image_plan(cfg, root=project, enroot_mount=False, force=True)
    frozen = project / "images" / f".build-{plan.hash[:12]}.yaml"
    argv = compute_argv(cfg, plan, force=True, do_import=True)
    assert argv == ["srun", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=00:45:00",
                    "--account=a-07", "--partition=debug", "--job-name=slipway-image",
                    sys.executable, "-m", "jobs", "image", "build", "--here", str(frozen), "--force"]
    # The image code alone does not know Slurm: it says which command does.
    with pytest.raises(ToolError, match="slipway image build"):
        build_image(cfg, root=project, force=True)
    # Through the srun stand-in the inner build runs the podman and enroot stand-ins.
    result = build(cfg, root=project, force=True)
    argvs = [c["argv"] for c in calls(fakes)]
    assert [c["argv"] for c in calls(fakes, "srun")] == [argv]
    assert any(a[:2] == ["podman", "build"] and "--no-cache" in a for a in argvs)
    assert any(a[:2] == ["enroot", "import"] and "-o" in a for a in argvs)
    assert result.squashfs == plan.squashfs and plan.squashfs.is_file()
    assert not frozen.exists()
    assert resolve_image(cfg, root=project) == plan.squashfs.resolve()


# ---------------------------------------------------------------- build, import, no-op


def test_build_import_is_atomic_and_recorded(project: Path, fakes: Path, tmp_path: Path):
    cfg = make_cfg(base_image=TEST_BASE, flash_attn=False)
    plan = image_plan(cfg, root=project, enroot_mount=False)
    out = plan.output_dir
    out.mkdir()
    # Leftovers of an interrupted import (a dead pid on this host) must not block the new one.
    stale = out / f".{plan.squashfs.name}.tmp-{host_name()}-999999999"
    stale.write_bytes(b"half")
    result = build_image(cfg, root=project)
    assert result.built and "import" in result.timings and result.squashfs == plan.squashfs
    assert plan.squashfs.read_bytes().startswith(b"hsqs")
    assert not stale.exists() and not list(out.glob(".*.tmp-*")) and not list(out.glob(".context-*"))
    (enroot_call,) = [c for c in calls(fakes, "enroot") if c["argv"][1] == "import" and "--help" not in c["argv"]]
    assert enroot_call["argv"] == plan.enroot_argv  # written under the temp name, renamed after
    assert enroot_call["squash"] == "-comp zstd -Xcompression-level 3 -b 1M"
    podman_build = [c["argv"] for c in calls(fakes, "podman") if c["argv"][1] == "build"]
    assert podman_build == [plan.podman_argv]
    # The record, the sidecar and the stable link.
    record = current_image(cfg, root=project)
    assert record == BuildRecord.read(plan.sidecar)
    assert record.hash == plan.hash and record.tag == plan.tag
    assert record.squashfs == str(plan.squashfs) and record.base_image == TEST_BASE
    assert record.size_bytes == plan.squashfs.stat().st_size and record.enroot_version == "3.5.0"
    assert plan.link.is_symlink() and os.readlink(plan.link) == plan.squashfs.name
    assert resolve_image(cfg, root=project) == plan.squashfs
    assert "STEP 2/2" in plan.log.read_text()
    assert record.cuda is None and record.flash_attn_archs is None  # a base without CUDA, flash-attn off


def test_the_record_carries_the_images_cuda_and_flash_attn_architectures(project: Path, fakes: Path, monkeypatch):
    """What doctor compares with the nodes: the image's CUDA (its ENV CUDA_VERSION, as NGC sets it)
    and the architectures flash-attn is compiled for (the Dockerfile's default, or the build arg).
    An older record, without them, still reads."""
    monkeypatch.setenv("FAKE_IMAGE_ENV", "CUDA_VERSION=13.1.0.036\nNVIDIA_REQUIRE_CUDA=cuda>=13.1")
    record = build_image(make_cfg(base_image=TEST_BASE), root=project).record
    assert record.cuda == "13.1.0.036" and record.flash_attn_archs == "90"
    assert record.flash_attn_serves("9.0") is True and record.flash_attn_serves("10.0") is False
    assert record.flash_attn_serves("8.0") is False
    other = build_image(make_cfg(base_image=TEST_BASE, build_args={"FLASH_ATTN_CUDA_ARCHS": ""}), root=project).record
    assert other.flash_attn_archs == "80;90;100;120" and other.flash_attn_serves("8.9") is True
    old = {k: v for k, v in json.loads(record.to_json()).items() if k not in ("cuda", "flash_attn_archs")}
    assert BuildRecord.from_json(old).cuda is None and BuildRecord.from_json(old).flash_attn_serves("9.0") is None


def test_noop_build_does_not_call_podman(project: Path, fakes: Path):
    cfg = make_cfg(base_image=TEST_BASE, flash_attn=False)
    first = build_image(cfg, root=project)
    n_podman = len(calls(fakes, "podman"))
    again = build_image(cfg, root=project)
    assert not again.built and "import" not in again.timings and again.squashfs == first.squashfs
    assert len(calls(fakes, "podman")) == n_podman

    # A change builds a second image; going back re-points the link without building.
    (project / "configs" / "extra.yaml").write_text("run: {}\n")
    second = build_image(cfg, root=project)
    assert second.built and second.squashfs != first.squashfs
    assert resolve_image(cfg, root=project) == second.squashfs
    (project / "configs" / "extra.yaml").unlink()
    n_podman = len(calls(fakes, "podman"))
    back = build_image(cfg, root=project)
    assert not back.built and back.squashfs == first.squashfs
    assert resolve_image(cfg, root=project) == first.squashfs
    assert current_image(cfg, root=project).hash == first.plan.hash
    assert len(calls(fakes, "podman")) == n_podman


def test_images_directory_removed_imports_again_without_rebuilding(project: Path, fakes: Path):
    """podman still has the image, the squashfs and its folder are gone (images/ removed to
    free space, or image.output_dir changed): import again, logging into a new logs/."""
    cfg = make_cfg(base_image=TEST_BASE, flash_attn=False)
    first = build_image(cfg, root=project)
    shutil.rmtree(first.plan.output_dir)
    again = build_image(cfg, root=project)
    assert not again.built and "import" in again.timings and again.squashfs == first.squashfs
    assert again.squashfs.read_bytes().startswith(b"hsqs")
    assert "enroot import" in again.plan.log.read_text()
    assert len([c for c in calls(fakes, "podman") if c["argv"][1] == "build"]) == 1  # built once


def test_failed_import_leaves_no_file(project: Path, fakes: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FAKE_ENROOT_MODE", "fail")
    cfg = make_cfg(base_image=TEST_BASE)
    with pytest.raises(ToolError, match=r"enroot import failed \(exit 1\).*podman image localhost/slipway:"):
        build_image(cfg, root=project)
    out = project / "images"
    assert not list(out.glob("*.sqsh")) and not list(out.glob(".*.tmp-*"))
    assert current_image(cfg, root=project) is None
    assert enroot_containers(fakes) == []  # the failed import's container went too
    # The retry imports without rebuilding (the podman tag exists).
    monkeypatch.setenv("FAKE_ENROOT_MODE", "upstream")
    result = build_image(cfg, root=project)
    assert not result.built and "import" in result.timings and result.squashfs.is_file()


@pytest.mark.slow
def test_interrupted_import_leaves_no_file(project: Path, fakes: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FAKE_ENROOT_MODE", "hang")
    out = project / "images"
    proc = subprocess.Popen([sys.executable, "-m", "jobs", "image", "build", "configs/tiny_cpu.yaml"], cwd=project,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=default_signals)
    deadline = time.time() + 30
    while not list(out.glob(".slipway-*.sqsh.tmp-*")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert list(out.glob(".slipway-*.sqsh.tmp-*")), proc.communicate()[0]
    proc.send_signal(signal.SIGINT)  # Ctrl-C while enroot writes
    output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, output
    assert not list(out.glob("*.sqsh")) and not list(out.glob(".*.tmp-*")) and not list(out.glob(".context-*"))
    assert enroot_containers(fakes) == []  # removed after the interrupt too


@pytest.mark.skipif(not (shutil.which("mksquashfs") and shutil.which("unsquashfs")), reason="needs squashfs-tools")
def test_whole_squashfs_kept_when_enroot_exits_nonzero(project: Path, fakes: Path,
                                                       monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FAKE_ENROOT_MODE", "exit127")
    result = build_image(make_cfg(), root=project)
    assert "import" in result.timings and result.squashfs.is_file()
    assert any("exited 127" in n for n in result.notes)


def test_missing_tools_say_what_to_do(project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(ToolError, match="podman not found on PATH: install podman"):
        build_image(make_cfg(), root=project)
    # With podman but no enroot: the podman image is built, then a one-line error.
    write_standins(empty, "podman")
    cfg = make_cfg()
    with pytest.raises(ToolError) as exc:
        build_image(cfg, root=project)
    tag = image_plan(cfg, root=project, enroot_mount=False).tag
    assert str(exc.value) == (f"enroot not found: install enroot (https://github.com/NVIDIA/enroot) or run "
                              f"`make image` on a node that has it; the podman image {tag} is built")
    # --no-import stops after the build, no error.
    result = build_image(cfg, root=project, do_import=False)
    assert result.squashfs is None and not result.built  # the tag exists already
    with pytest.raises(ToolError, match="srun not found"):
        build(make_cfg(build_on="compute"), root=project)


def test_base_that_cannot_be_pulled(project: Path, fakes: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FAKE_PODMAN_FAIL", "pull")
    base = re.escape(ImageSection().base_image)
    with pytest.raises(ToolError, match=rf"podman could not pull the base image {base}: .*no such host.*"
                                        r"image.network_host"):
        build_image(make_cfg(), root=project)
    assert not list((project / "images").glob(".context-*"))


def test_free_space_check(tmp_path: Path):
    check_free_space(image_size=1024, output_dir=tmp_path / "images", temp_dir=tmp_path)
    with pytest.raises(ToolError, match=r"not enough disk for enroot import: .*the squashfs in .* and the image "
                                        r"unpacked by enroot in .*ENROOT_TEMP_PATH"):
        check_free_space(image_size=1 << 60, output_dir=tmp_path / "images", temp_dir=tmp_path)
    # With -x mount enroot unpacks nothing: only the squashfs counts.
    free = shutil.disk_usage(tmp_path).free
    check_free_space(image_size=int(free * 1.5), output_dir=tmp_path, temp_dir=None)


def test_regular_file_at_the_link_is_not_overwritten(project: Path, fakes: Path):
    (project / "images").mkdir()
    (project / "images" / "slipway.sqsh").write_text("someone's own image")
    with pytest.raises(ToolError, match="is a regular file"):
        build_image(make_cfg(), root=project)
    assert (project / "images" / "slipway.sqsh").read_text() == "someone's own image"


# ---------------------------------------------------------------- prune


@pytest.mark.slow
def test_prune_keeps_the_current_image(project: Path, fakes: Path):
    cfg = make_cfg()
    made, made_tags = [], []
    for i in range(3):
        (project / "configs" / "v.yaml").write_text(f"run: {{seed: {i}}}\n")
        result = build_image(cfg, root=project)
        made.append(result.squashfs)
        made_tags.append(result.record.tag)
        os.utime(made[-1], (time.time() - 100 + i, time.time() - 100 + i))
    # Make the oldest current again (back to its sources): the two others go with keep=1.
    (project / "configs" / "v.yaml").write_text("run: {seed: 0}\n")
    assert build_image(cfg, root=project).squashfs == made[0]
    assert len(list((project / "images").glob("slipway-*.sqsh"))) == 3
    removed = prune_images(cfg, keep=2, pinned={}, root=project)
    assert removed.ok and made[1] in removed.removed and made[1].with_suffix(".json") in removed.removed
    assert made[0].exists() and made[2].exists() and not made[1].exists()
    removed = prune_images(cfg, keep=1, pinned={}, root=project)
    assert removed.ok and made[2] in removed.removed and made[0].exists()
    assert resolve_image(cfg, root=project) == made[0]
    tags = [c["argv"][2] for c in calls(fakes, "podman") if c["argv"][1] == "rmi"]
    assert sorted(tags) == sorted(made_tags[1:])
    again = prune_images(cfg, keep=1, pinned={}, root=project)
    assert again.ok and not (again.removed or again.tags or again.containers)
    with pytest.raises(ConfigError, match="--keep"):
        prune_images(cfg, keep=0, pinned={}, root=project)


# ---------------------------------------------------------------- enroot's leftover containers


def podman_standin(bin_dir: Path, *args: str) -> str:
    return subprocess.run([str(bin_dir / "podman"), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_import_removes_only_its_own_leftover_container(project: Path, fakes: Path, tmp_path: Path):
    cfg = make_cfg(base_image=TEST_BASE, flash_attn=False)
    build_image(cfg, root=project, do_import=False)  # the tag exists, no squashfs yet
    tag = image_plan(cfg, root=project, enroot_mount=False).tag
    # Two containers that are not this import's: an earlier import's leftover of the same
    # tag, and another image's.
    podman_standin(fakes, "build", "-t", "localhost/other:1", str(tmp_path))
    podman_standin(fakes, "create", "--name", "enroot.Earlier001", tag)
    podman_standin(fakes, "create", "--name", "enroot.OtherImage", "localhost/other:1")
    result = build_image(cfg, root=project)
    assert "import" in result.timings and result.squashfs.is_file()
    # The stand-in did what upstream enroot does: created enroot.XXXXXXXXXX, exited 1 after a whole write.
    (created,) = [c["argv"] for c in calls(fakes, "podman") if c["argv"][1] == "create" and
                  not c["argv"][3].startswith(("enroot.Earlier", "enroot.Other"))]
    name = created[3]
    assert re.fullmatch(r"enroot\.[A-Za-z0-9]{10}", name) and created[4] == tag
    assert f"removed enroot's leftover podman container {name}" in result.notes
    assert any(n.startswith("enroot exited 1 but the squashfs reads back whole: kept (its cleanup calls `docker rm`")
               for n in result.notes)
    left = sorted(c["Names"][0] for c in enroot_containers(fakes))
    assert left == ["enroot.Earlier001", "enroot.OtherImage"]
    removed = [c["argv"] for c in calls(fakes, "podman") if c["argv"][1] == "rm"]
    assert len(removed) == 1 and removed[0][:3] == ["podman", "rm", "-v"]


def test_import_with_a_working_docker_leaves_nothing_to_clean(project: Path, fakes: Path,
                                                              monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FAKE_ENROOT_MODE", "docker")
    result = build_image(make_cfg(base_image=TEST_BASE), root=project)
    assert "import" in result.timings and result.notes == [] and enroot_containers(fakes) == []
    assert not [c for c in calls(fakes, "podman") if c["argv"][1] == "rm" and c["argv"][2] == "-v"]


def test_import_warns_when_its_leftover_cannot_be_removed(project: Path, fakes: Path,
                                                          monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FAKE_PODMAN_RM_FAIL", r"^enroot\.")
    result = build_image(make_cfg(base_image=TEST_BASE), root=project)
    assert "import" in result.timings  # the squashfs is fine: a warning, not an error
    (name,) = [c["Names"][0] for c in enroot_containers(fakes)]
    (warning,) = [n for n in result.notes if n.startswith("could not remove")]
    assert warning.startswith(f"could not remove enroot's leftover podman container {name} (exit 2: Error: cleaning up "
                              "storage")
    assert warning.endswith("`slipway image prune` retries")


def run_prune(project: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs", "image", "prune", "configs/tiny_cpu.yaml"], cwd=project,
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "500", **env})


@pytest.mark.slow
def test_prune_removes_leftovers_and_reports_what_it_cannot(project: Path, fakes: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch):
    cfg = make_cfg()
    # An import whose leftover could not be removed (as every import before slipway cleaned up).
    monkeypatch.setenv("FAKE_PODMAN_RM_FAIL", r"^enroot\.")
    (project / "configs" / "v.yaml").write_text("run: {seed: 1}\n")
    old = build_image(cfg, root=project)
    (old_leftover,) = [c["Names"][0] for c in enroot_containers(fakes)]
    monkeypatch.delenv("FAKE_PODMAN_RM_FAIL")
    (project / "configs" / "v.yaml").unlink()
    current = build_image(cfg, root=project)
    assert [c["Names"][0] for c in enroot_containers(fakes)] == [old_leftover]
    # An import of the current tag still running (it holds the tag's lock), and another image's leftover.
    podman_standin(fakes, "create", "--name", "enroot.Running001", current.plan.tag)
    running_import = Project.of(project).building(current.plan.tag)
    running_import.__enter__()
    podman_standin(fakes, "build", "-t", "localhost/other:1", str(tmp_path))
    podman_standin(fakes, "create", "--name", "enroot.OtherImage", "localhost/other:1")

    # podman rm fails: the leftover stays, so does the tag it uses; each said on one line, exit 1.
    first = run_prune(project, FAKE_PODMAN_RM_FAIL=old_leftover)
    assert first.returncode == 1, first.stdout + first.stderr
    failed = sorted(line for line in first.stdout.splitlines() if line.startswith("could not remove"))
    assert len(failed) == 2, first.stdout
    leftover, tag = (next(line for line in failed if line.startswith(f"could not remove {what}"))
                     for what in (f"podman container {old_leftover}", "podman tag"))
    assert leftover.startswith(f"could not remove podman container {old_leftover} (left by enroot import of "
                               f"{old.plan.tag}): podman rm exit 2: Error: cleaning up storage")
    assert tag == (f"could not remove podman tag {old.plan.tag}: podman rmi exit 2: Error: image used by "
                   f"{enroot_id(fakes, old_leftover)}: image is in use by a container: consider listing "
                   "external containers and force-removing image")
    running = (f"kept podman container enroot.Running001 (left by enroot import of {current.plan.tag}): a build or "
               "import of it is running now")
    assert running in first.stdout.splitlines()
    assert "left alone 1 enroot import containers of other projects' or unlabelled images: enroot.OtherImage " \
           "(localhost/other:1)" in first.stdout
    assert "error: prune could not remove 2 item(s)" in first.stderr
    assert f"removed {old.squashfs}" in first.stdout  # the files went all the same

    # rm works now: the leftover goes, then its tag; the running import's container is still kept.
    second = run_prune(project)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"removed podman container {old_leftover} (left by enroot import of {old.plan.tag})" in second.stdout
    assert f"removed podman tag {old.plan.tag}" in second.stdout
    assert running in second.stdout.splitlines()

    # The import is over (its lock is free): everything of ours goes, another image's stays.
    running_import.__exit__(None, None, None)
    third = run_prune(project)
    assert third.returncode == 0, third.stdout + third.stderr
    assert "removed podman container enroot.Running001" in third.stdout
    assert [c["Names"][0] for c in enroot_containers(fakes)] == ["enroot.OtherImage"]
    assert podman_standin(fakes, "images").splitlines().count(current.plan.tag) == 1
    assert resolve_image(cfg, root=project) == current.squashfs


def enroot_id(bin_dir: Path, name: str) -> str:
    (cid,) = [c["Id"] for c in enroot_containers(bin_dir) if c["Names"][0] == name]
    return cid


# ---------------------------------------------------------------- build failures, diagnosed


def dockerfile_steps() -> list[str]:
    """The STEP lines podman prints for containers/Dockerfile: instructions after FROM's
    ARG, continuation lines joined as podman joins them."""
    instructions, current = [], ""
    for line in (REPO / "containers" / "Dockerfile").read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1]
            continue
        instructions.append(current + line)
        current = ""
    instructions = instructions[next(i for i, text in enumerate(instructions) if text.startswith("FROM ")):]
    return [f"STEP {i}/{len(instructions)}: {text}" for i, text in enumerate(instructions, 1)]


def failed_build_log(mark: str, output: list[str], *, earlier: tuple[str, ...] = (), runtime: bool = False) -> str:
    """A podman build log failing at the step whose text holds `mark`, as podman writes it:
    cached steps, `earlier` as the previous (successful) step's output, then `output` and
    podman's trailer (crun's variant for `runtime`)."""
    steps = dockerfile_steps()
    at = next(i for i, step in enumerate(steps) if mark in step and (": RUN " in step or mark.startswith("FROM")))
    lines = ["$ podman build -f containers/Dockerfile -t localhost/slipway:0123456789ab --build-arg FLASH_ATTN=1 "
             "--build-arg FLASH_ATTN_VERSION=2.8.3.post2 images/.context-0123456789ab"]
    for step in steps[:at]:
        lines += [step, "--> Using cache 3f0c2b7d9a41e5f6a7b8c9d0e1f2a3b4c5d6e7f8091a2b3c4d5e6f7a8b9c0d1e"]
    if earlier:
        lines[-1:] = list(earlier) + ["--> 5d41402abc4"]
    instruction = steps[at].split(": ", 1)[1]
    lines += [steps[at], *output]
    if runtime:
        lines += [": exit status 1", 'time="2026-11-23T12:20:27Z" level=error msg="did not get container create '
                  'message from subprocess: EOF"',
                  f'Error: building at STEP "{" ".join(instruction.split())}": while running runtime: exit status 1']
    else:
        lines += ["subprocess exited with status 1", "subprocess exited with status 1",
                  f'Error: building at STEP "{" ".join(instruction.split())}": exit status 1']
    return "\n".join(lines) + "\n"


FLASH_STEP, DEPS_STEP, SOURCES_STEP, SMOKE_STEP, FROM_STEP = \
    "FLASH_ATTN_VERSION", "pip_requirements.py", "--no-deps", '"$SMOKE"', "FROM ${BASE_IMAGE}"
def run_step(mark: str) -> str:
    (step,) = [s for s in dockerfile_steps() if mark in s and ": RUN " in s]
    return step


FLASH_RUN = " ".join(run_step(FLASH_STEP).split(": RUN ", 1)[1].split())
PIP_WARNING = ("ERROR: pip's dependency resolver does not currently take into account all the packages that are "
               "installed. This behaviour is the source of the following dependency conflicts.")
DIAGNOSES = {
    # crun on this machine, quoted from a real `podman build` without --isolation chroot: the cause
    # sits after the whole RUN command (which mentions flash-attn, built or not).
    "cgroups at the flash-attn step, flash_attn false": dict(
        mark=FLASH_STEP, args={"FLASH_ATTN": "0"}, runtime=True,
        output=[f"error running container: from /usr/bin/crun creating container for [/bin/sh -c {FLASH_RUN}]: "
                "cgroups in hybrid mode not supported, drop all controllers from cgroupv2"],
        want=[r"^podman build failed at the flash-attn step \(STEP \d+/\d+\) \(exit 1\): error running container: "
              r"from /usr/bin/crun creating contain … .*: cgroups in hybrid mode not "
              r"supported, drop all controllers from cgroupv2\. Fix: .*set image\.isolation: chroot"],
        never=["flash_attn: false", "MAX_JOBS", "wheelhouse"]),
    "setrlimit": dict(
        mark=DEPS_STEP, runtime=True,
        output=["error running container: from /usr/bin/crun creating container for [/bin/sh -c set -eu; cd "
                "/opt/slipway/deps]: setrlimit `RLIMIT_NOFILE`: Operation not permitted: OCI permission denied"],
        want=[r"failed at the dependencies step .*setrlimit `RLIMIT_NOFILE`: Operation not permitted.*"
              r"Fix: .*image\.isolation: chroot"], never=["flash"]),
    "disk full in pip": dict(
        mark=DEPS_STEP, earlier=(PIP_WARNING,),
        output=["Installing collected packages: pyarrow, datasets",
                "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device"],
        want=[r"\(exit 1\): ERROR: Could not install packages due to an OSError: \[Errno 28\] No space left on "
              r"device\. Fix: free disk where podman keeps its storage \(graphroot"], never=["dependency resolver"]),
    "the base cannot be pulled": dict(
        mark=FROM_STEP, rc=125,
        output=["Trying to pull nvcr.io/nvidia/pytorch:25.12-py3...",
                "Error: creating build container: initializing source docker://nvcr.io/nvidia/pytorch:25.12-py3: "
                "pinging container registry nvcr.io: Get \"https://nvcr.io/v2/\": dial tcp: lookup nvcr.io: no such "
                "host"],
        want=[r"^podman could not pull the base image nvcr\.io/nvidia/pytorch:25\.12-py3: Error: creating build "
              r"container: .*no such host\. Fix: .*image\.network_host: true.*podman login nvcr\.io"]),
    "a wheel missing from the offline wheelhouse": dict(
        mark=DEPS_STEP, args={"WHEELHOUSE": "offline", "FLASH_ATTN": "0"}, earlier=(PIP_WARNING,),
        output=["pip_requirements: 9 requirements (keeping the image's torch 2.10.0a0+b4e4ee81d3.nv25.12)",
                "Looking in links: /tmp/wheels", "Processing /tmp/wheels/PyYAML-6.0.2-cp312-cp312-manylinux.whl",
                "ERROR: Could not find a version that satisfies the requirement datasets>=2.19 (from versions: none)",
                "ERROR: No matching distribution found for datasets>=2.19"],
        want=[r"failed at the dependencies step .*: ERROR: No matching distribution found for datasets>=2\.19\. "
              r"Fix: the offline wheelhouse \(image\.wheelhouse\) lacks it .*pip download -d WHEELHOUSE"],
        never=["flash", "dependency resolver"]),
    "TLS inside the build": dict(
        mark=DEPS_STEP,
        output=["WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after "
                "connection broken by 'SSLError(SSLCertVerificationError(1, '[SSL: CERTIFICATE_VERIFY_FAILED] "
                "certificate verify failed: unable to get local issuer certificate (_ssl.c:1006)'))': "
                "/simple/datasets/",
                "ERROR: Could not find a version that satisfies the requirement datasets>=2.19 (from versions: none)",
                "ERROR: No matching distribution found for datasets>=2.19"],
        want=[r"CERTIFICATE_VERIFY_FAILED.*Fix: pip inside the build cannot verify TLS.*image\.wheelhouse: DIR"]),
    "flash-attn does not compile: the first error": dict(
        mark=FLASH_STEP,
        output=["flash-attn: compiling 2.8.3.post2 against torch 2.10.0a0+b4e4ee81d3.nv25.12, CUDA 13.1 on aarch64 "
                "(MAX_JOBS=auto NVCC_THREADS=4 archs 80;90;100;120): up to hours on aarch64",
                "  Building wheel for flash-attn (setup.py): started",
                *[f"      [{i}/73] /usr/local/cuda/bin/nvcc -c csrc/flash_attn/src/flash_fwd_hdim{i}_bf16_sm80.cu"
                  for i in range(1, 40)],
                "      csrc/flash_attn/src/flash_fwd_kernel.h(42): error: namespace \"cute\" has no member "
                "\"TiledMMA\"",
                "      csrc/flash_attn/src/flash_fwd_kernel.h(57): error: identifier \"Tensor\" is undefined",
                "      2 errors detected in the compilation of \"csrc/flash_attn/src/flash_fwd_hdim64_bf16_sm80.cu\".",
                "      ninja: build stopped: subcommand failed.",
                "      RuntimeError: Error compiling objects for extension",
                "  ERROR: Failed building wheel for flash-attn",
                "ERROR: Could not build wheels for flash-attn, which is required to install pyproject.toml-based "
                "projects"],
        want=[r"failed at the flash-attn step .*: csrc/flash_attn/src/flash_fwd_kernel\.h\(42\): error: namespace "
              r"\"cute\" has no member \"TiledMMA\"\. Fix: flash-attn 2\.8\.3\.post2 does not compile against this "
              r"base's torch and CUDA.*FLASH_ATTN_VERSION.*image\.wheelhouse.*image\.flash_attn: false"]),
    "flash-attn compiler killed (memory)": dict(
        mark=FLASH_STEP,
        output=["      [12/73] /usr/local/cuda/bin/nvcc -c csrc/flash_attn/src/flash_bwd_hdim128_bf16_sm90.cu",
                "      g++: fatal error: Killed signal terminated program cc1plus",
                "      compilation terminated.", "      ninja: build stopped: subcommand failed.",
                "  ERROR: Failed building wheel for flash-attn"],
        want=[r"g\+\+: fatal error: Killed signal terminated program cc1plus\. Fix: the compiler ran out of memory "
              r"building flash-attn .*MAX_JOBS=2 make image.*FLASH_ATTN_CUDA_ARCHS.*image\.wheelhouse"]),
    # pip's output from compiling flash-attn 2.8.3.post2 on this machine (no CUDA).
    "flash-attn on a base without CUDA": dict(
        mark=FLASH_STEP,
        output=["  Preparing metadata (setup.py): finished with status 'error'",
                "  error: subprocess-exited-with-error", "      torch.__version__  = 2.13.0+cpu",
                "      Traceback (most recent call last):",
                "        File \"/usr/local/lib/python3.11/dist-packages/torch/utils/cpp_extension.py\", line 3302, in "
                "_join_cuda_home",
                "      OSError: CUDA_HOME environment variable is not set. Please set it to your CUDA install root.",
                "  note: This error originates from a subprocess, and is likely not a problem with pip.",
                "error: metadata-generation-failed"],
        want=[r"OSError: CUDA_HOME environment variable is not set.*Fix: flash-attn compiles against the base's CUDA "
              r"toolkit and this base has none: set image\.flash_attn: false"]),
    "the flash-attn step's own check": dict(
        mark=FLASH_STEP,
        output=["flash-attn: installing the prebuilt flash_attn-2.8.3.post2+cu13torch2.10cxx11abiTRUE-cp312-cp312-"
                "linux_aarch64.whl from the wheelhouse",
                "flash-attn FAILED: installed, but `import flash_attn` fails (ImportError: flash_attn_2_cuda.cpython-"
                "312-aarch64-linux-gnu.so: undefined symbol: _ZN3c104cuda9SetDeviceEa): it does not match the base's "
                "torch 2.10.0a0 / CUDA 13.1; use a wheel built for them, compile it (remove the wheel), or set "
                "image.flash_attn: false"],
        want=[r"\(exit 1\): flash-attn FAILED: installed, but `import flash_attn` fails \(ImportError: .*undefined "
              r"symbol.*or set image\.flash_attn: false; full log: "], never=[". Fix:"]),
    "the smoke test without flash-attn": dict(
        mark=SMOKE_STEP, args={"FLASH_ATTN": "1"},
        output=["smoke FAILED: RuntimeError: the image was built with flash-attn (SLIPWAY_FLASH_ATTN=1) but `import "
                "flash_attn` fails (ModuleNotFoundError: No module named 'flash_attn'): rebuild it for this torch "
                "2.10.0a0 (a matching wheel in image.wheelhouse, or compile it), or set image.flash_attn: false"],
        want=[r"^podman build failed at the smoke test \(STEP \d+/\d+\) \(exit 1\): smoke FAILED: RuntimeError: the "
              r"image was built with flash-attn \(SLIPWAY_FLASH_ATTN=1\).*Fix: the smoke test runs one training step"],
        never=["MAX_JOBS"]),
    "pip conflict mentioning flash-attn, flash_attn false": dict(
        mark=DEPS_STEP, args={"FLASH_ATTN": "0"},
        output=["ERROR: Cannot install slipway because these package versions have conflicting dependencies.",
                "The conflict is caused by:", "    slipway 0.1.0 depends on torch>=2.10",
                "    flash-attn 2.8.3 depends on torch", "ERROR: ResolutionImpossible: for help visit "
                "https://pip.pypa.io/en/latest/topics/dependency-resolution/#dealing-with-dependency-conflicts"],
        want=[r"\(exit 1\): ERROR: ResolutionImpossible.*Fix: the requirements conflict"],
        never=["flash_attn: false", "MAX_JOBS"]),
    "a pin of the base's conflicts with the dependencies": dict(
        mark=DEPS_STEP, args={"FLASH_ATTN": "0"},
        output=["ERROR: Cannot install datasets==5.2.0 because these package versions have conflicting dependencies.",
                "The conflict is caused by:", "    datasets 5.2.0 depends on fsspec<=2026.9.0 and >=2023.1.0",
                "    The user requested (constraint) fsspec==2021.4.0", "ERROR: ResolutionImpossible: for help visit "
                "https://pip.pypa.io/en/latest/topics/dependency-resolution/#dealing-with-dependency-conflicts",
                "dependencies FAILED: the base image pins fsspec==2021.4.0 in its pip constraints (/etc/pip/constraint"
                ".txt, PIP_CONSTRAINT), but datasets 5.2.0 needs fsspec<=2026.9.0 and >=2023.1.0: set image.build_args."
                "PIP_CONSTRAINT_LIFT: \"fsspec\" to lift that pin for slipway's dependencies (the base's own packages "
                "were built against it: check they still work), or use a base image whose pins fit"],
        want=[r"^podman build failed at the dependencies step \(STEP \d+/\d+\) \(exit 1\): dependencies FAILED: the base "
              r"image pins fsspec==2021\.4\.0 .*PIP_CONSTRAINT_LIFT: \"fsspec\".*whose pins fit; full log: "],
        never=[". Fix:"]),
    "numactl cannot be installed": dict(
        mark="numactl FAILED", args={"FLASH_ATTN": "0"},
        output=["E: Unable to locate package numactl", "numactl FAILED: the run binds each rank to a NUMA node "
                "(launch.preset with torchrun --numa-binding), which needs numactl, and it could not be installed in "
                "the base (no network for its package manager?): use a base image with numactl, or set "
                "launch.preset: none"],
        want=[r"^podman build failed at the numactl step \(STEP \d+/\d+\) \(exit 1\): numactl FAILED: .*or set "
              r"launch\.preset: none; full log: "], never=[". Fix:"]),
    "anything else: a traceback's last line": dict(
        mark=SOURCES_STEP,
        output=["Processing /opt/slipway", "Traceback (most recent call last):", "  File \"<string>\", line 1",
                "ModuleNotFoundError: No module named 'setuptools'", "Cleaning up..."],
        want=[r"failed at the sources step .*: ModuleNotFoundError: No module named 'setuptools'; full log: "]),
}


@pytest.mark.parametrize("case", list(DIAGNOSES), ids=list(DIAGNOSES))
def test_build_failure_diagnosis(case: str, tmp_path: Path):
    spec = DIAGNOSES[case]
    args = {"BASE_IMAGE": "nvcr.io/nvidia/pytorch:25.12-py3", "FLASH_ATTN": "1", "FLASH_ATTN_VERSION": "2.8.3.post2",
            "WHEELHOUSE": "", **spec.get("args", {})}
    text = failed_build_log(spec["mark"], spec["output"], earlier=spec.get("earlier", ()),
                            runtime=spec.get("runtime", False))
    log = tmp_path / "logs" / "slipway-0123456789ab.log"
    message = diagnose_build(text, build_args=args, log=log, rc=spec.get("rc", 1))
    assert "\n" not in message and len(message) < 1200 and message.endswith(f"full log: {log}")
    for pattern in spec["want"]:
        assert re.search(pattern, message), f"{pattern!r} not in:\n{message}"
    for text_ in spec.get("never", []):
        assert text_ not in message, message
    assert "Error: building at STEP" not in message and "did not get container create message" not in message


def test_flash_attn_is_blamed_only_when_built_and_failing():
    flash = run_step(FLASH_STEP)
    output = ["Traceback (most recent call last):", "KeyError: 'x'"]
    built = diagnose_build("\n".join([flash, *output]), build_args={"FLASH_ATTN": "1"}, log=Path("l"), rc=1)
    assert "flash-attn builds against the base's torch and CUDA" in built
    for args, step in (({"FLASH_ATTN": "0"}, flash), ({"FLASH_ATTN": "1"}, run_step(SMOKE_STEP))):
        message = diagnose_build("\n".join([step, *output]), build_args=args, log=Path("l"), rc=1)
        assert "flash-attn builds" not in message and message.endswith("KeyError: 'x'; full log: l")


# ---------------------------------------------------------------- flash-attn: wheels and compile settings


def test_flash_attn_wheel_must_fit_python_torch_cuda_and_abi():
    target = Target(python="cp312", machine="aarch64", torch="2.10", cuda="13", cxx11abi=True)
    fits = "flash_attn-2.8.3.post2+cu13torch2.10cxx11abiTRUE-cp312-cp312-linux_aarch64.whl"
    trusted = "flash_attn-2.8.3.post2-cp312-cp312-linux_aarch64.whl"  # `pip wheel` in the base: no tags
    names = {
        "flash_attn-2.8.3.post2+cu13torch2.9cxx11abiTRUE-cp312-cp312-linux_aarch64.whl": "built for torch 2.9",
        "flash_attn-2.8.3.post2+cu12torch2.10cxx11abiTRUE-cp312-cp312-linux_aarch64.whl": "built for CUDA 12",
        "flash_attn-2.8.3.post2+cu13torch2.10cxx11abiFALSE-cp312-cp312-linux_aarch64.whl": "cxx11abiFALSE",
        "flash_attn-2.8.3.post2+cu13torch2.10cxx11abiTRUE-cp311-cp311-linux_aarch64.whl": "this Python is cp312",
        "flash_attn-2.8.3.post2+cu13torch2.10cxx11abiTRUE-cp312-cp312-linux_x86_64.whl": "this machine is aarch64",
        "flash_attn-2.7.4.post1+cu13torch2.10cxx11abiTRUE-cp312-cp312-linux_aarch64.whl":
            "not FLASH_ATTN_VERSION=2.8.3.post2 (set image.build_args.FLASH_ATTN_VERSION",
    }
    others = ["flash_attn-2.8.3.post2.tar.gz", "torch-2.10.0-cp312-cp312-linux_aarch64.whl"]
    chosen, notes = pick([*names, fits, trusted, *others], "2.8.3.post2", target)
    assert chosen == fits  # named for this torch: preferred over one taken on trust
    assert len(notes) == len(names)
    for name, why in names.items():
        assert any(n.startswith(f"flash-attn: not using {name}: ") and why in n for n in notes), (name, notes)
    assert pick([trusted, *others], "2.8.3.post2", target) == (trusted, [])
    assert pick(others, "2.8.3.post2", target) == (None, [])  # nothing fits: compile from the sdist


@pytest.mark.slow
def test_flash_attn_wheel_script_as_the_build_runs_it(tmp_path: Path):
    import platform

    import torch

    py = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    abi = str(bool(torch._C._GLIBCXX_USE_CXX11_ABI)).upper()
    good = f"flash_attn-2.8.3.post2+torch{release}cxx11abi{abi}-{py}-{py}-linux_{platform.machine()}.whl"
    bad = f"flash_attn-2.8.3.post2+torch1.0cxx11abi{abi}-{py}-{py}-linux_{platform.machine()}.whl"
    for name in (good, bad):
        (tmp_path / name).write_bytes(b"")
    out = subprocess.run([sys.executable, str(REPO / "containers" / "flash_attn_wheel.py"), str(tmp_path),
                          "2.8.3.post2"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(tmp_path / good)
    assert f"flash-attn: not using {bad}: built for torch 1.0, the base has torch {release}" in out.stderr


@pytest.mark.slow
def test_smoke_test_imports_flash_attn_when_the_image_has_it(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture):
    import types

    from trainer import smoke

    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` fails
    monkeypatch.delenv("SLIPWAY_FLASH_ATTN", raising=False)
    assert smoke.check_flash_attn() == ""  # an image built without flash-attn does not need it
    monkeypatch.setenv("SLIPWAY_FLASH_ATTN", "0")
    assert smoke.check_flash_attn() == ""
    monkeypatch.setenv("SLIPWAY_FLASH_ATTN", "1")
    assert smoke.main() == 1
    err = capsys.readouterr().err
    assert err.startswith("smoke FAILED: RuntimeError: the image was built with flash-attn (SLIPWAY_FLASH_ATTN=1) "
                          "but `import flash_attn` fails (ModuleNotFoundError: ") and "image.flash_attn: false" in err
    assert err.count("\n") == 1  # one line, as the build diagnosis quotes it
    fake = types.ModuleType("flash_attn")
    fake.__version__ = "2.8.3.post2"
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    assert smoke.main() == 0
    assert capsys.readouterr().out.startswith("smoke ok: loss ") and "flash-attn 2.8.3.post2)" in \
        smoke.smoke()


_PYTHON3_STUB = """#!{python}
# python3 as the flash-attn step calls it, in a base with torch {{STUB_TORCH}}: records pip installs.
import json, os, sys
from pathlib import Path
sys.path.insert(0, {repo!r})
here = Path(__file__).resolve().parent
installed = here / "installed"
args = sys.argv[1:]
if args[0] == "-c" and "import torch" in args[1]:
    print(os.environ["STUB_TORCH"])
elif args[0] == "-c" and "version('flash-attn')" in args[1]:
    sys.exit(0 if installed.exists() and not print(installed.read_text()) else 1)
elif args[0] == "-c" and "import flash_attn" in args[1]:
    if not installed.exists() or os.environ.get("STUB_IMPORT_FAIL"):
        sys.exit("ImportError: flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEa")
elif args[0].endswith("flash_attn_wheel.py"):
    from containers.flash_attn_wheel import Target, pick
    chosen, notes = pick(os.listdir(args[1]), args[2], Target("cp312", "aarch64", "2.10", "13", True))
    print("\\n".join(notes), file=sys.stderr)
    if chosen:
        print(os.path.join(args[1], chosen))
elif args[:3] == ["-m", "pip", "install"]:
    env = {{k: os.environ[k] for k in ("MAX_JOBS", "NVCC_THREADS", "FLASH_ATTN_CUDA_ARCHS", "PIP_CONSTRAINT")
           if k in os.environ}}
    with open(here / "pip.jsonl", "a") as f:
        f.write(json.dumps({{"argv": args[3:], "env": env}}) + "\\n")
    what = args[-1]  # flash-attn==VERSION, or a wheel's path
    installed.write_text(what.split("==")[1] if "==" in what else os.path.basename(what).split("-")[1].split("+")[0])
else:
    sys.exit("python3 stub: unexpected " + repr(args))
"""


def dockerfile_arg(name: str) -> str:
    """The default of one ARG in containers/Dockerfile."""
    (value,) = re.findall(rf"^ARG {name}=(.*)$", (REPO / "containers" / "Dockerfile").read_text(), re.M)
    return value.strip('"')


def run_flash_attn_step(tmp_path: Path, *, wheels: tuple[str, ...] = (), build_env: dict | None = None,
                        torch: str = "2.10.0a0+b4e4ee81d3.nv25.12 13.1", base_has: str = "",
                        **env: str) -> tuple[int, str, list[dict]]:
    """The Dockerfile's flash-attn RUN script, run by sh with the build's paths moved under
    tmp_path and a stub python3: (exit code, output, the pip installs it ran)."""
    script = run_step(FLASH_STEP).split(": RUN ", 1)[1]
    script = script[script.index("set -eu;"):]
    ctx.materialize_context([], tmp_path / "context", build_env)
    for name in wheels:
        (tmp_path / "context" / "wheels" / name).write_bytes(b"")
    for old, new in (("/tmp/wheels", tmp_path / "context" / "wheels"), ("/tmp/buildenv", tmp_path / "context" /
                     "buildenv"), ("/tmp/torch-constraint.txt", tmp_path / "torch-constraint.txt"),
                     ("/opt/slipway/build/flash_attn_wheel.py", "flash_attn_wheel.py")):
        script = script.replace(old, str(new))
    stub = tmp_path / "bin" / "python3"
    stub.parent.mkdir()
    stub.write_text(_PYTHON3_STUB.format(python=sys.executable, repo=str(REPO)))
    stub.chmod(0o755)
    if base_has:  # the base's own flash-attn
        (stub.parent / "installed").write_text(base_has)
    args = {"FLASH_ATTN": "1", "FLASH_ATTN_VERSION": "2.8.3.post2",
            "FLASH_ATTN_CUDA_ARCHS": dockerfile_arg("FLASH_ATTN_CUDA_ARCHS"),
            "FLASH_ATTN_COMPILE_VERSION": dockerfile_arg("FLASH_ATTN_COMPILE_VERSION"),
            "WHEELHOUSE": "offline", "WHEELHOUSE_DIGEST": "", **env}  # ARGs reach RUN as environment
    base_env = {k: v for k, v in os.environ.items() if k not in ("MAX_JOBS", "NVCC_THREADS")}
    proc = subprocess.run(["sh", "-c", script], capture_output=True, text=True, cwd=tmp_path,
                          env={**base_env, **args, "STUB_TORCH": torch, "PATH": f"{stub.parent}:{os.environ['PATH']}"})
    pip = tmp_path / "bin" / "pip.jsonl"
    installs = [json.loads(line) for line in pip.read_text().splitlines()] if pip.exists() else []
    return proc.returncode, proc.stdout + proc.stderr, installs


def test_flash_attn_step_installs_a_fitting_wheel_else_compiles(tmp_path: Path):
    fitting = "flash_attn-2.8.3.post2+cu13torch2.10cxx11abiTRUE-cp312-cp312-linux_aarch64.whl"
    other_torch = "flash_attn-2.8.3.post2+cu13torch2.9cxx11abiTRUE-cp312-cp312-linux_aarch64.whl"
    # A wheel that fits: installed as it is, against the base's torch, nothing compiled.
    rc, out, installs = run_flash_attn_step(tmp_path / "a", wheels=(fitting, other_torch),
                                            build_env={"MAX_JOBS": "3"})
    assert rc == 0, out
    assert f"flash-attn: installing the prebuilt wheel {fitting} from the wheelhouse because the base has no " \
           "flash-attn" in out
    assert f"flash-attn: not using {other_torch}: built for torch 2.9, the base has torch 2.10" in out
    (install,) = installs
    assert install["argv"][-1].endswith(f"/wheels/{fitting}") and "--no-build-isolation" not in install["argv"]
    assert install["env"]["PIP_CONSTRAINT"] == ""  # a base's pip constraints (NGC's) do not pin flash-attn
    assert (tmp_path / "a" / "torch-constraint.txt").exists() is False
    assert f"flash-attn 2.8.3.post2 imports: prebuilt wheel {fitting} from the wheelhouse" in out
    # Only a wheel for another torch: compiled from source, never that wheel, with buildenv's MAX_JOBS,
    # for the nodes' architecture alone by default (H100 and GH200: 90), and said so.
    rc, out, installs = run_flash_attn_step(tmp_path / "b", wheels=(other_torch,),
                                            build_env={"MAX_JOBS": "3", "NVCC_THREADS": "2"})
    assert rc == 0, out
    (install,) = installs
    assert install["argv"][:4] == ["--no-build-isolation", "--no-binary", "flash-attn", "-c"]
    assert install["argv"][-1] == "flash-attn==2.8.3.post2"
    assert install["env"] == {"MAX_JOBS": "3", "NVCC_THREADS": "2", "FLASH_ATTN_CUDA_ARCHS": "90", "PIP_CONSTRAINT": ""}
    assert "flash-attn: compiling 2.8.3.post2 because the base has no flash-attn and no wheel in the wheelhouse " \
           "fits, for CUDA architectures 90 (H100, GH200; image.build_args.FLASH_ATTN_CUDA_ARCHS for others), " \
           "against torch 2.10.0a0+b4e4ee81d3.nv25.12, CUDA 13.1 on " in out
    assert "flash-attn 2.8.3.post2 imports: compiled 2.8.3.post2" in out
    assert "(MAX_JOBS=3 NVCC_THREADS=2): up to hours on aarch64" in out
    # No MAX_JOBS: flash-attn chooses; the user's architecture list reaches the compile; an empty one
    # is unset (flash-attn would read "" as no architecture at all) and compiles flash-attn's four.
    rc, out, installs = run_flash_attn_step(tmp_path / "c", FLASH_ATTN_CUDA_ARCHS="80;90")
    assert rc == 0 and installs[0]["env"] == {"FLASH_ATTN_CUDA_ARCHS": "80;90", "PIP_CONSTRAINT": ""}
    assert "MAX_JOBS=auto" in out and "for CUDA architectures 80;90 (image.build_args.FLASH_ATTN_CUDA_ARCHS)" in out
    rc, out, installs = run_flash_attn_step(tmp_path / "c2", FLASH_ATTN_CUDA_ARCHS="")
    assert rc == 0 and installs[0]["env"] == {"PIP_CONSTRAINT": ""}
    assert "for CUDA architectures 80;90;100;120 (flash-attn's default: FLASH_ATTN_CUDA_ARCHS is empty)" in out
    # A CPU torch, or a flash-attn that does not import: the build stops with slipway's own line.
    rc, out, installs = run_flash_attn_step(tmp_path / "d", torch="2.13.0+cpu ")
    assert rc == 1 and installs == []
    assert "flash-attn FAILED: the base's torch 2.13.0+cpu is a CPU build, and flash-attn needs CUDA: set " \
           "image.flash_attn: false or use a CUDA base" in out
    rc, out, _ = run_flash_attn_step(tmp_path / "e", wheels=(fitting,), STUB_IMPORT_FAIL="1")
    assert rc == 1 and "flash-attn FAILED: installed, but `import flash_attn` fails (ImportError: flash_attn_2_cuda" \
                       ".so: undefined symbol: _ZN3c104cuda9SetDeviceEa): it does not match the base's torch " \
                       "2.10.0a0+b4e4ee81d3.nv25.12 / CUDA 13.1" in out
    # The base's own flash-attn: kept when it imports and no other version is asked for, even with a
    # wheel in the wheelhouse; replaced (and said why) when FLASH_ATTN_VERSION names another.
    rc, out, installs = run_flash_attn_step(tmp_path / "g", base_has="2.8.3.post2")
    assert rc == 0 and installs == []
    assert "flash-attn: kept from the base: its flash-attn 2.8.3.post2 is FLASH_ATTN_VERSION" in out
    rc, out, installs = run_flash_attn_step(tmp_path / "i", base_has="2.7.4.post1", wheels=(fitting,),
                                            FLASH_ATTN_VERSION="")
    assert rc == 0 and installs == []
    assert "flash-attn: kept from the base: its flash-attn 2.7.4.post1 imports (image.build_args.FLASH_ATTN_VERSION: " \
           "another version replaces it)" in out and "flash-attn 2.7.4.post1 imports: kept from the base" in out
    rc, out, installs = run_flash_attn_step(tmp_path / "h", base_has="2.7.4.post1")
    assert rc == 0 and [i["argv"][-1] for i in installs] == ["flash-attn==2.8.3.post2"]
    assert "flash-attn: compiling 2.8.3.post2 because FLASH_ATTN_VERSION=2.8.3.post2 asked for, the base has " \
           "2.7.4.post1 and no wheel in the wheelhouse fits" in out
    # No version asked for and none in the base: the Dockerfile's compile version, known to build on CUDA 13.1.
    compile_version = dockerfile_arg("FLASH_ATTN_COMPILE_VERSION")
    rc, out, installs = run_flash_attn_step(tmp_path / "j", FLASH_ATTN_VERSION="")
    assert rc == 0 and [i["argv"][-1] for i in installs] == [f"flash-attn=={compile_version}"]
    assert f"flash-attn: compiling {compile_version} because the base has no flash-attn and no wheel" in out
    # A base's flash-attn that does not import is not kept.
    rc, out, installs = run_flash_attn_step(tmp_path / "k", base_has="2.7.4.post1", FLASH_ATTN_VERSION="",
                                            STUB_IMPORT_FAIL="1")
    assert rc == 1 and [i["argv"][-1] for i in installs] == [f"flash-attn=={compile_version}"]
    assert f"flash-attn: compiling {compile_version} because the base's flash-attn 2.7.4.post1 does not import " \
           "(ImportError: flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEa)" in out
    # FLASH_ATTN=0: nothing at all.
    rc, out, installs = run_flash_attn_step(tmp_path / "f", FLASH_ATTN="0")
    assert rc == 0 and installs == [] and out.strip() == "flash-attn: skipped (FLASH_ATTN=0)"


def test_what_the_run_needs_of_the_image_are_build_args(project: Path):
    """train.float8 installs the float8 extra; a launch that binds NUMA nodes, numactl; flash-attn
    compiles for the nodes' architecture. Each changes the image's hash, so an image without
    them is not the one the config builds (submit's stale-image note then names the build arg)."""
    base = plan_of(project)
    assert not {"EXTRAS", "NUMACTL", "FLASH_ATTN_CUDA_ARCHS"} & set(base.build_args)  # the Dockerfile's defaults
    assert dockerfile_arg("FLASH_ATTN_CUDA_ARCHS") == "90" and dockerfile_arg("NUMACTL") == "0"
    cfg = make_cfg()
    cfg.train.float8 = True
    float8 = image_plan(cfg, root=project, enroot_mount=False)
    assert float8.build_args["EXTRAS"] == "float8" and float8.hash != base.hash
    cfg.image.build_args = {"EXTRAS": "plot"}  # the user's extras, and float8 for the run
    assert image_plan(cfg, root=project, enroot_mount=False).build_args["EXTRAS"] == "plot float8"
    cfg = make_cfg()
    cfg.launch.preset, cfg.launch.launcher = "alps-gh200", "torchrun"
    numa = image_plan(cfg, root=project, enroot_mount=False)
    assert cfg.binds_numa and numa.build_args["NUMACTL"] == "1" and numa.hash != base.hash
    cfg.image.build_args = {"NUMACTL": "0"}  # the user's build arg cannot take away what the preset needs
    with pytest.raises(ConfigError, match=r"^image\.build_args\.NUMACTL: 0 leaves numactl out, .*launch\.preset: none$"):
        image_plan(cfg, root=project, enroot_mount=False)
    cfg.image.build_args = {}
    cfg.launch.launcher = "srun"  # srun binds with --cpu-bind: no numactl
    assert "NUMACTL" not in image_plan(cfg, root=project, enroot_mount=False).build_args
    with pytest.raises(ConfigError, match=r"^image\.build_args\.NUMACTL: must be 0 or 1"):
        plan_of(project, build_args={"NUMACTL": "yes"})


def test_max_jobs_from_build_args_and_the_environment(project: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    base = plan_of(project)
    plan = plan_of(project, build_args={"MAX_JOBS": "8", "NVCC_THREADS": "2"})
    assert plan.build_env == {"MAX_JOBS": "8", "NVCC_THREADS": "2"} and plan.hash == base.hash
    assert not [a for a in plan.podman_argv if a.startswith(("MAX_JOBS", "NVCC_THREADS"))]
    monkeypatch.setenv("MAX_JOBS", "3")  # `MAX_JOBS=3 make image` wins over the config
    assert plan_of(project, build_args={"MAX_JOBS": "8"}).build_env == {"MAX_JOBS": "3"}
    monkeypatch.setenv("MAX_JOBS", "")  # set but empty: ignored
    assert plan_of(project).build_env == {}
    monkeypatch.setenv("MAX_JOBS", "0")
    with pytest.raises(ConfigError, match=r"^MAX_JOBS \(in the environment of make image\): must be a whole number "
                                          r">= 1, got '0'"):
        plan_of(project)
    monkeypatch.delenv("MAX_JOBS")
    with pytest.raises(ConfigError, match=r"^image\.build_args\.NVCC_THREADS: must be a whole number"):
        plan_of(project, build_args={"NVCC_THREADS": "lots"})
    with pytest.raises(ConfigError, match=r"^image\.build_args\.FLASH_ATTN: must be 0 or 1, got 'yes': set "
                                          r"image\.flash_attn"):
        plan_of(project, build_args={"FLASH_ATTN": "yes"})
    # The context's buildenv/flash-attn.env, read by the Dockerfile's flash-attn step with `.`.
    ctx.materialize_context([], tmp_path / "c", {"MAX_JOBS": "4", "NVCC_THREADS": "2"})
    env_file = tmp_path / "c" / "buildenv" / "flash-attn.env"
    read = subprocess.run(["sh", "-c", f'set -a; . {env_file}; sh -c \'echo "$MAX_JOBS $NVCC_THREADS"\''],
                          capture_output=True, text=True, check=True)
    assert read.stdout == "4 2\n"
    ctx.materialize_context([], tmp_path / "d")
    assert (tmp_path / "d" / "buildenv" / "flash-attn.env").read_text() == ""


# ---------------------------------------------------------------- storage.conf, requirements, Dockerfile


def test_storage_conf_checks(tmp_path: Path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n"
                      "10.0.0.1@o2ib:/scratch /capstor/scratch lustre rw 0 0\n")
    conf = tmp_path / "storage.conf"
    conf.write_text('[storage]\ndriver = "overlay"\nrunroot = "/dev/shm/$USER/runroot"\n'
                    'graphroot = "/dev/shm/$USER/root"\n')
    assert all(c.ok for c in check_storage_conf(conf, mounts))
    conf.write_text('[storage]\ndriver = "vfs"\nrunroot = "/dev/shm/r"\ngraphroot = "/capstor/scratch/u/podman"\n')
    checks = check_storage_conf(conf, mounts)
    bad = [c for c in checks if not c.ok]
    assert [c.what.split()[1] for c in bad] == ["graphroot", "storage"]
    assert "lustre" in bad[0].what and "/dev/shm/$USER/root" in bad[0].fix
    assert bad[0].what.startswith("podman graphroot /capstor/scratch/u/podman is on lustre")
    assert filesystem_type(Path("/capstor/scratch/new/dir"), mounts) == "lustre"
    conf.write_text("[storage\n")
    assert not check_storage_conf(conf, mounts)[0].ok


def test_pip_requirements_keep_the_images_torch(tmp_path: Path):
    project = toml_loads((REPO / "pyproject.toml").read_text())
    with_torch = requirements(project, have_torch=True)
    without = requirements(project, have_torch=False)
    torch_reqs = [r for r in without if requirement_name(r) == "torch"]
    assert len(torch_reqs) == 1 and torch_reqs[0].startswith("torch>=")
    assert not [r for r in with_torch if requirement_name(r) == "torch"]
    assert set(without) - set(with_torch) == set(torch_reqs)
    assert "pyyaml>=6.0" in with_torch  # the runtime deps come along (trainer.config reads YAML)
    # The script as the Dockerfile runs it, here where torch is installed.
    out = subprocess.run([sys.executable, str(REPO / "containers" / "pip_requirements.py"), str(REPO / "pyproject.toml"),
                          str(tmp_path / "r.txt"), str(tmp_path / "c.txt")], capture_output=True, text=True, check=True)
    assert "keeping the image's torch" in out.stdout
    assert (tmp_path / "c.txt").read_text().startswith("torch==")
    assert "torch" not in (tmp_path / "r.txt").read_text().replace("tomli-w", "")


# pip 26's explanation of a conflict with a constraint, as it prints it (the real builds below
# reach it for real): the pinned version is on the index, or pip found none at all.
PIP_CONFLICT = """ERROR: Cannot install datasets==5.2.0 and torch==2.13.0+cpu because these package versions have conflicting dependencies.

The conflict is caused by:
    torch 2.13.0+cpu depends on fsspec>=0.8.5
    datasets 5.2.0 depends on fsspec[http]<=2026.9.0 and >=2023.1.0
    The user requested (constraint) fsspec==2021.4.0

Additionally, some packages in these conflicts have no matching distributions available for your environment:
    fsspec

To fix this you could try to:
1. loosen the range of package versions you've specified
"""


def test_a_conflict_with_a_pin_of_the_base_is_one_line_with_the_way_out(tmp_path: Path):
    from containers.pip_requirements import base_pins, explain_conflict, lift_pins

    pins_file = tmp_path / "constraint.txt"
    pins_file.write_text("# NGC's\nfsspec==2021.4.0\nPyYAML==6.0.1  # pinned\n-c other.txt\n\n")
    constraint = f"{pins_file} https://example.org/c.txt {tmp_path / 'missing.txt'}"  # as pip reads PIP_CONSTRAINT
    pins = base_pins(constraint)
    assert pins == {"fsspec": ("fsspec==2021.4.0", str(pins_file)), "pyyaml": ("PyYAML==6.0.1", str(pins_file))}
    line = explain_conflict(PIP_CONFLICT, pins, set())
    assert line == (f"dependencies FAILED: the base image pins fsspec==2021.4.0 in its pip constraints ({pins_file}, "
                    "PIP_CONSTRAINT), but datasets 5.2.0 needs fsspec[http]<=2026.9.0 and >=2023.1.0: set "
                    "image.build_args.PIP_CONSTRAINT_LIFT: \"fsspec\" to lift that pin for slipway's dependencies "
                    "(the base's own packages were built against it: check they still work), or use a base image "
                    "whose pins fit")  # torch's fsspec>=0.8.5 takes 2021.4.0: not named
    # Offline without that version: nobody's range excludes it, pip just has none; a lift asked for already stays.
    unsatisfiable = PIP_CONFLICT.replace("    datasets 5.2.0 depends on fsspec[http]<=2026.9.0 and >=2023.1.0\n", "")
    line = explain_conflict(unsatisfiable, pins, {"pyyaml"})
    assert "but pip finds no fsspec==2021.4.0 to install (neither on the index nor in image.wheelhouse)" in line
    assert 'PIP_CONSTRAINT_LIFT: "fsspec pyyaml"' in line
    assert explain_conflict(PIP_CONFLICT, {}, set()) is None  # not a base pin: pip's own words, diagnosed
    assert explain_conflict("ERROR: No matching distribution found for x", pins, set()) is None
    value, lifted = lift_pins(constraint, {"fsspec"}, tmp_path / "lifted.txt")
    assert value == str(tmp_path / "lifted.txt") and lifted == ["fsspec==2021.4.0"]
    assert "fsspec" not in (tmp_path / "lifted.txt").read_text() and "PyYAML==6.0.1" in (tmp_path / "lifted.txt").read_text()


def test_pip_requirements_take_the_runs_extras(tmp_path: Path):
    script = [sys.executable, str(REPO / "containers" / "pip_requirements.py"), str(REPO / "pyproject.toml"),
              str(tmp_path / "r.txt"), str(tmp_path / "c.txt")]
    out = subprocess.run([*script, "--extras", "float8"], capture_output=True, text=True, check=True)
    assert "(extras trainer, plot, float8;" in out.stdout and "torchao>=" in (tmp_path / "r.txt").read_text()
    bad = subprocess.run([*script, "--extras", "float9"], capture_output=True, text=True)
    assert bad.returncode == 1
    assert bad.stdout.strip() == ("dependencies FAILED: pyproject.toml has no optional-dependencies.float9 "
                                  "(EXTRAS='float9'): name an extra pyproject.toml has")


def test_dockerfile_contract():
    text = (REPO / "containers" / "Dockerfile").read_text()
    assert f"ARG BASE_IMAGE={ImageSection().base_image}\n" in text  # in sync with the config default
    # The steps the diagnosis names, each found by a text only its RUN holds.
    runs = [step for step in dockerfile_steps() if ": RUN " in step]
    for name, mark in STEP_NAMES:
        assert len([r for r in runs if mark in r]) == 1, (name, mark)
    flash = run_step(FLASH_ATTN_STEP_MARK)
    # MAX_JOBS / NVCC_THREADS reach the compile through the buildenv/ bind mount, never as build args.
    assert "ARG MAX_JOBS" not in text and "ARG NVCC_THREADS" not in text
    assert "source=buildenv,target=/tmp/buildenv" in flash and ". /tmp/buildenv/flash-attn.env" in flash
    assert "flash_attn_wheel.py /tmp/wheels" in flash and "--no-binary flash-attn" in flash
    order = [text.index(s) for s in ("COPY src/containers/flash_attn_wheel.py", "flash-attn==$version",
                                     "ENV SLIPWAY_FLASH_ATTN=${FLASH_ATTN}\n", 'sh -c "$SMOKE"')]
    assert order == sorted(order), "the image says whether it has flash-attn before the smoke test reads it"
    assert "pip install --no-build-isolation" in text and 'flash-attn==$version' in text
    assert 'ARG FLASH_ATTN_VERSION=""\n' in text  # unset: a base's working flash-attn is kept
    assert "ARG FLASH_ATTN=1" in text and "--no-deps" in text
    assert 'CMD ["bash"]' in text and "org.opencontainers.image.revision" in text
    order = [text.index(s) for s in ("flash-attn==", "ARG NUMACTL", "numactl FAILED", "ARG EXTRAS",
                                     "COPY src/pyproject.toml", "--install", "COPY src/ /opt/slipway/",
                                     "sh -c \"$SMOKE\"", "ARG GIT_COMMIT")]
    assert order == sorted(order), "layers must run from rarely to often changed"
    # A run's needs are ARGs declared after flash-attn's step: a new value never recompiles it.
    assert "ARG NUMACTL" not in text[:text.index("flash-attn==")] and "ARG EXTRAS" not in text[:text.index("ARG NUMACTL")]


def test_cli_show(project: Path, fakes: Path):
    out = subprocess.run([sys.executable, "-m", "jobs", "image", "show", "configs/tiny_cpu.yaml"], cwd=project,
                         capture_output=True, text=True, env={**os.environ, "COLUMNS": "300"})
    assert out.returncode == 0, out.stderr
    plan = image_plan(load_config(project / "configs" / "tiny_cpu.yaml"), root=project, enroot_mount=False)
    assert f"tag       {plan.tag}" in out.stdout and "(not built)" in out.stdout
    assert "ENROOT_SQUASH_OPTIONS='-comp zstd -Xcompression-level 3 -b 1M' enroot import -o" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "jobs", "image", "build", "configs/tiny_cpu.yaml", "image.name=Bad Name"],
                         cwd=project, capture_output=True, text=True)
    assert bad.returncode == 2 and "image.name" in bad.stderr


# ---------------------------------------------------------------- a real podman build


def real_prune_of_import_leftovers(cfg: Config, root: Path, tmp_path: Path) -> float:
    """With the real podman: a second image of this project (tag only, its only tag) with an
    `enroot.*` container made from it, as an import leaves it. While its import holds the tag's
    lock both stay; then prune removes the container, then the tag (podman refuses the tag while
    the container exists)."""
    t0 = time.perf_counter()
    podman = Podman.find()
    other = Config()
    other.image = dataclasses.replace(cfg.image, build_args={"SMOKE": f"python3 -m trainer.smoke  # {uuid.uuid4()}"})
    old = build_image(other, root=root, do_import=False, console=Console(quiet=True)).plan.tag
    current = image_plan(cfg, root=root, enroot_mount=False, git=False).tag
    name = f"enroot.{uuid.uuid4().hex[:10]}"
    subprocess.run([podman.exe, "create", "--name", name, old], check=True, capture_output=True)
    quiet = Console(quiet=True)
    try:
        with Project.of(root).building(old):  # its import runs
            first = prune_images(cfg, keep=1, pinned={}, root=root, console=quiet)
        assert first.ok and old not in first.tags and name not in first.containers, first.failed
        assert first.kept_tags.get(old) == "a build or import of it is running now"
        second = prune_images(cfg, keep=1, pinned={}, root=root, console=quiet)
        assert second.ok, second.failed
        assert second.containers == [name] and old in second.tags
        assert not [c for c in podman.containers(Enroot.CONTAINER_FILTER) if c.name == name]
        assert not podman.image_exists(old) and podman.image_exists(current)
    finally:
        podman.remove_container(name)
    return time.perf_counter() - t0


def own_project(root: Path, key: str) -> Project:
    """`root` as the project of this worktree's runs of test `key`: the same id each run, so a run
    removes the images its earlier runs left (keeping podman's layer cache in its newest), and
    never one of another checkout's runs of the same test sharing the storage."""
    import hashlib

    ident = hashlib.sha256(f"{REPO}\0{key}".encode()).hexdigest()[:32]
    (root / ".slipway").mkdir(parents=True, exist_ok=True)
    (root / ".slipway" / "project").write_text(json.dumps({"id": ident, "root": str(root)}) + "\n")
    return Project.of(root)


def untag_own(project: Project, repository: str, keep: str = "") -> None:
    """Untag what `project` labelled in `repository`, but `keep`."""
    podman = Podman.find()
    for tag, labels in podman.tags(repository).items():
        if labels.get("slipway.project") == project.id and tag != keep:
            podman.untag(tag)


def _podman_ok() -> str | None:
    if shutil.which("podman") is None:
        return "podman is not installed"
    if os.geteuid() != 0:
        return "the real build runs podman as root (--isolation chroot); not root here"
    return None


def ensure_test_base(tag: str = TEST_BASE) -> None:
    """A Debian bookworm base with python3 + pip, made once and kept in podman storage."""
    if subprocess.run(["podman", "image", "exists", tag]).returncode == 0:
        return
    if shutil.which("mmdebstrap") is None:
        pytest.skip(f"the base image {tag} is missing and mmdebstrap (Debian package) is not installed to make it")
    CACHE.mkdir(exist_ok=True)
    tar = CACHE / "testbase-rootfs.tar"
    subprocess.run(["mmdebstrap", "--variant=apt", "--include=python3,python3-pip,python3-venv", "bookworm",
                    str(tar)], check=True, capture_output=True)
    subprocess.run(["podman", "import", str(tar), tag], check=True, capture_output=True)
    tar.unlink()


def ensure_wheelhouse() -> Path:
    """The trainer's dependencies for the image's Python 3.11, downloaded on the host once."""
    wheels = CACHE / "wheelhouse"
    # The float8 extra too: a config with train.float8 gets torchao in its image.
    reqs = requirements(toml_loads((REPO / "pyproject.toml").read_text()), have_torch=False,
                        extras=(*EXTRAS, "float8"))
    # The CPU torch this machine has as a wheel (the image installs whatever satisfies pyproject's torch here).
    reqs = ["torch==2.13.0" if requirement_name(r) == "torch" else r for r in reqs]
    stamp = wheels / ".requirements"
    if stamp.is_file() and stamp.read_text() == "\n".join(reqs):
        return wheels
    wheels.mkdir(parents=True, exist_ok=True)
    if sys.version_info[:2] != (3, 11):
        pytest.skip("the wheelhouse is downloaded for this Python, and the test base's Python is 3.11")
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "-d", str(wheels),
                    *reqs], check=True)
    stamp.write_text("\n".join(reqs))
    return wheels


@pytest.mark.podman
def test_real_podman_build_then_noop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    reason = _podman_ok()
    if reason:
        pytest.skip(reason)
    ensure_test_base()
    wheels = ensure_wheelhouse()
    bin_dir = tmp_path / "bin"
    if shutil.which("enroot") is None:
        # enroot is not packaged here: the stand-in does enroot's podman:// import (podman export + mksquashfs).
        write_standins(bin_dir, "enroot")
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.setenv("FAKE_ENROOT_MODE", "real")
    monkeypatch.setenv("ENROOT_TEMP_PATH", str(tmp_path))
    # A fresh smoke step each run (the layers before it come from podman's cache).
    root = copy_sources(tmp_path / "src")
    owner = own_project(root, "real-build")
    smoke = "python3 -m trainer.smoke" if (root / "trainer" / "smoke.py").is_file() else \
        "python3 -c 'import trainer.config, torch, datasets; print(\"smoke ok (import only)\", torch.__version__)'"
    podman = shutil.which("podman")
    cfg = make_cfg(name="slipway-test", base_image=TEST_BASE, flash_attn=False, isolation="chroot",
                   wheelhouse=str(wheels), output_dir=str(tmp_path / "images"), squash_options="-comp lz4",
                   build_args={"SMOKE": f"{smoke}  # run {uuid.uuid4().hex[:8]}"})
    tag = image_plan(cfg, root=root, enroot_mount=False, git=False).tag
    t0 = time.perf_counter()
    try:
        result = build_image(cfg, root=root)
        build_s = time.perf_counter() - t0
        assert result.built and "import" in result.timings and result.squashfs.is_file()
        log = result.plan.log.read_text()
        assert "smoke ok" in log
        reqs = subprocess.run(["unsquashfs", "-cat", str(result.squashfs), "opt/slipway/deps/requirements.txt"],
                              capture_output=True, text=True, check=True).stdout
        # This base has no torch: pyproject's requirement went in, and one was installed from the wheelhouse.
        assert [r for r in reqs.split() if requirement_name(r) == "torch"]
        listing = subprocess.run(["unsquashfs", "-l", str(result.squashfs)], capture_output=True, text=True).stdout
        site = "/usr/local/lib/python3.11/dist-packages"
        assert f"{site}/trainer/__init__.py" in listing and f"{site}/torch/__init__.py" in listing
        assert "/opt/slipway/configs/tiny_cpu.yaml" in listing
        env = subprocess.run([podman, "image", "inspect", "--format", "{{.Config.Env}}", tag], capture_output=True,
                             text=True, check=True).stdout
        assert "SLIPWAY_FLASH_ATTN=0" in env  # what the trainer reads: built without flash-attn
        # enroot's podman:// import made a container and left it (as upstream does without docker): removed.
        assert any(n.startswith("removed enroot's leftover podman container enroot.") for n in result.notes)
        assert [c for c in Podman(podman).containers(Enroot.CONTAINER_FILTER) if c.image == tag] == []

        # Nothing changed: no podman at all, back in well under a second or two.
        write_standins(tmp_path / "nopodman", "podman-forbidden")
        monkeypatch.setenv("PATH", f"{tmp_path / 'nopodman'}{os.pathsep}{os.environ['PATH']}")
        t1 = time.perf_counter()
        again = build_image(cfg, root=root)
        noop_s = time.perf_counter() - t1
        assert not again.built and again.squashfs == result.squashfs
        assert calls(tmp_path / "nopodman") == []
        assert noop_s < 2.0
        monkeypatch.setenv("PATH", os.environ["PATH"].split(os.pathsep, 1)[1])
        prune_s = real_prune_of_import_leftovers(cfg, root, tmp_path)
        t = result.timings
        print(f"\n[real podman build] {build_s:.1f} s: build {t['build']:.1f} s ({log.count('Using cache')} steps "
              f"cached), import {t['import']:.1f} s, squashfs {img.human(result.record.size_bytes)}; no-op {noop_s * 1000:.0f} ms; "
              f"leftover + prune {prune_s:.1f} s; smoke: {smoke!r}")
    finally:
        # Keep this run's tag only: it holds podman's layer cache for the next run (removing the
        # last tag of a chain removes its cached layers too). Only this worktree's runs' tags.
        untag_own(owner, "localhost/slipway-test", keep=tag)


@pytest.mark.podman
def test_real_build_flash_attn_on_a_cpu_base_fails_clearly(tmp_path: Path):
    reason = _podman_ok()
    if reason:
        pytest.skip(reason)
    ensure_test_base()
    cfg = make_cfg(name="slipway-test", base_image=TEST_BASE, flash_attn=True, isolation="chroot",
                   output_dir=str(tmp_path / "images"))
    with pytest.raises(ToolError, match=r"^podman build failed at the flash-attn step \(STEP \d+/\d+\) \(exit 1\): "
                                        r"flash-attn FAILED: the base image has no torch, and flash-attn builds "
                                        r"against the base's torch and CUDA: set image.flash_attn: false for a base "
                                        r"without CUDA; full log: "):
        build_image(cfg, root=copy_sources(tmp_path / "src"), do_import=False)


@pytest.mark.podman
def test_real_smoke_test_requires_flash_attn_when_the_image_says_so(tmp_path: Path):
    """SLIPWAY_FLASH_ATTN=1 (what FLASH_ATTN=1 sets in the image) without flash-attn fails the
    build at the smoke test; set through SMOKE here, so every layer before it comes from the cache."""
    reason = _podman_ok()
    if reason:
        pytest.skip(reason)
    ensure_test_base()
    cfg = make_cfg(name="slipway-test", base_image=TEST_BASE, flash_attn=False, isolation="chroot",
                   wheelhouse=str(ensure_wheelhouse()), output_dir=str(tmp_path / "images"),
                   build_args={"SMOKE": f"SLIPWAY_FLASH_ATTN=1 python3 -m trainer.smoke  # {uuid.uuid4().hex[:8]}"})
    with pytest.raises(ToolError, match=r"^podman build failed at the smoke test \(STEP \d+/\d+\) \(exit 1\): smoke "
                                        r"FAILED: RuntimeError: the image was built with flash-attn "
                                        r"\(SLIPWAY_FLASH_ATTN=1\) but `import flash_attn` fails "
                                        r"\(ModuleNotFoundError: No module named 'flash_attn'\): .*or set "
                                        r"image.flash_attn: false\. Fix: the smoke test runs one training step"):
        build_image(cfg, root=copy_sources(tmp_path / "src"), do_import=False)


# ---------------------------------------------------------------- real builds: which flash-attn the image gets

CUDA_STANDIN_BASE = "localhost/slipway-testbase:py311-cuda-standin"
# A Containerfile for bases that look like CUDA ones to the flash-attn step: the CPU torch from
# the wheelhouse with torch.version.cuda set (nothing here runs CUDA: the smoke test trains on the
# CPU), and, with FLASH_ATTN_WHEEL, a stand-in flash_attn installed as a base's own.
_STANDIN_CONTAINERFILE = """FROM {base}
ARG FLASH_ATTN_WHEEL=""
RUN set -eu; \\
    python3 -m pip install --break-system-packages --no-index --find-links /w torch==2.13.0; \\
    f=$(python3 -c "import torch.version as v; print(v.__file__)"); \\
    sed -i "s/^cuda: Optional\\[str\\] = None$/cuda: Optional[str] = '13.1'/" "$f"; \\
    python3 -c "import torch; assert torch.version.cuda == '13.1', torch.version.cuda"; \\
    if [ -n "$FLASH_ATTN_WHEEL" ]; then python3 -m pip install --break-system-packages --no-index "/w/$FLASH_ATTN_WHEEL"; fi
"""


def link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem
        shutil.copy2(src, dst)


def ensure_cuda_standin_base(tag: str, wheels: Path, flash_attn_wheel: Path | None = None) -> None:
    """A base whose torch reports CUDA 13.1 (made once, kept in podman storage), with the given
    flash_attn wheel installed as the base's own."""
    if subprocess.run(["podman", "image", "exists", tag]).returncode == 0:
        return
    ensure_test_base()
    with_wheel = CACHE / "standin-base"
    shutil.rmtree(with_wheel, ignore_errors=True)
    with_wheel.mkdir(parents=True)
    (with_wheel / "Containerfile").write_text(_STANDIN_CONTAINERFILE.format(base=TEST_BASE))
    argv = ["podman", "build", "--isolation", "chroot", "-t", tag, "-f", str(with_wheel / "Containerfile"),
            "-v", f"{wheels}:/w:ro"]
    if flash_attn_wheel is not None:
        argv += ["--build-arg", f"FLASH_ATTN_WHEEL={flash_attn_wheel.name}"]
        wheels_with = with_wheel / "w"
        shutil.copytree(wheels, wheels_with, copy_function=link_or_copy, ignore=shutil.ignore_patterns(".*"))
        shutil.copy(flash_attn_wheel, wheels_with / flash_attn_wheel.name)
        argv[argv.index("-v") + 1] = f"{wheels_with}:/w:ro"
    try:
        subprocess.run([*argv, str(with_wheel)], check=True, capture_output=True, text=True)
    finally:
        shutil.rmtree(with_wheel, ignore_errors=True)


def wheelhouse_with(tmp_path: Path, *extra: Path) -> Path:
    """The trainer's wheelhouse plus `extra` wheels, as hard links (no copy of torch)."""
    wheels = tmp_path / "wheelhouse"
    shutil.copytree(ensure_wheelhouse(), wheels, copy_function=link_or_copy, ignore=shutil.ignore_patterns(".*"))
    for wheel in extra:
        shutil.copy(wheel, wheels / wheel.name)
    return wheels


def build_flash_attn_image(tmp_path: Path, base: str, wheels: Path) -> tuple[str, str, str]:
    """A real build (no import) on `base` with flash-attn on: (the flash-attn lines of the output, the
    whole log, the image's environment)."""
    cfg = make_cfg(name="slipway-flashtest", base_image=base, flash_attn=True, isolation="chroot",
                   wheelhouse=str(wheels), output_dir=str(tmp_path / "images"))
    root = copy_sources(tmp_path / "src")
    owner = own_project(root, "flash-attn")
    console = Console(file=open(tmp_path / "console.txt", "w"), width=400)
    podman = Podman.find()
    try:
        result = build_image(cfg, root=root, do_import=False, console=console)
        console.file.close()
        assert result.built
        env = subprocess.run([podman.exe, "image", "inspect", "--format", "{{.Config.Env}}", result.plan.tag],
                             capture_output=True, text=True, check=True).stdout
        return (tmp_path / "console.txt").read_text(), result.plan.log.read_text(), env
    finally:
        untag_own(owner, "localhost/slipway-flashtest")


@pytest.mark.podman
def test_real_build_keeps_the_bases_flash_attn(tmp_path: Path):
    """A base with a flash-attn that imports, no version asked for: kept, and said so, even with
    another version's wheel in the wheelhouse; the smoke test imports the base's."""
    reason = _podman_ok()
    if reason:
        pytest.skip(reason)
    own = flash_attn_standin_wheel(CACHE / "standin-flash-attn", "2.7.4.post1")
    base = CUDA_STANDIN_BASE + "-flash-attn-2.7.4.post1"
    ensure_cuda_standin_base(base, ensure_wheelhouse(), own)
    other = flash_attn_standin_wheel(tmp_path / "extra", "2.8.3", marker=uuid.uuid4().hex)
    console, log, env = build_flash_attn_image(tmp_path, base, wheelhouse_with(tmp_path, other))
    said = "flash-attn: kept from the base: its flash-attn 2.7.4.post1 imports (image.build_args.FLASH_ATTN_VERSION: " \
           "another version replaces it)"
    assert said in console and said in log, [line for line in console.splitlines() if "flash-attn" in line]
    assert "flash-attn 2.7.4.post1 imports: kept from the base" in console
    assert "Processing" not in log.split(said)[1].split("STEP")[0]  # pip installed nothing in that step
    assert re.search(r"smoke ok: loss .*flash-attn 2\.7\.4\.post1\)", log), log[-2000:]
    assert "SLIPWAY_FLASH_ATTN=1" in env


@pytest.mark.podman
def test_real_build_without_a_flash_attn_in_the_base_takes_the_wheelhouse(tmp_path: Path):
    """A base without flash-attn: the fitting wheel from the wheelhouse, and the output says why."""
    reason = _podman_ok()
    if reason:
        pytest.skip(reason)
    wheels = ensure_wheelhouse()
    ensure_cuda_standin_base(CUDA_STANDIN_BASE, wheels)
    wheel = flash_attn_standin_wheel(tmp_path / "extra", "2.8.3", marker=uuid.uuid4().hex)
    console, log, env = build_flash_attn_image(tmp_path, CUDA_STANDIN_BASE, wheelhouse_with(tmp_path, wheel))
    said = ("flash-attn: installing the prebuilt wheel flash_attn-2.8.3-py3-none-any.whl from the wheelhouse "
            "because the base has no flash-attn")
    assert said in console and said in log, [line for line in console.splitlines() if "flash-attn" in line]
    assert "flash-attn 2.8.3 imports: prebuilt wheel flash_attn-2.8.3-py3-none-any.whl from the wheelhouse" in console
    assert re.search(r"smoke ok: loss .*flash-attn 2\.8\.3\)", log), log[-2000:]
    assert "SLIPWAY_FLASH_ATTN=1" in env


# ---------------------------------------------------------------- real builds: the base's pins, the run's needs

# A base that pins packages the way NGC's images do: a pip constraint file that PIP_CONSTRAINT names.
_PINNED_CONTAINERFILE = """FROM {base}
COPY constraint.txt /etc/pip/constraint.txt
ENV PIP_CONSTRAINT=/etc/pip/constraint.txt
"""


def ensure_pinned_base(pins: list[str]) -> str:
    """The test base with `pins` in /etc/pip/constraint.txt (made once per set of pins)."""
    import hashlib

    ensure_test_base()
    tag = f"{TEST_BASE}-pins-{hashlib.sha256(chr(10).join(pins).encode()).hexdigest()[:10]}"
    if subprocess.run(["podman", "image", "exists", tag]).returncode == 0:
        return tag
    work = CACHE / f"pinned-base-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        (work / "Containerfile").write_text(_PINNED_CONTAINERFILE.format(base=TEST_BASE))
        (work / "constraint.txt").write_text("# the base's own pins\n" + "".join(p + "\n" for p in pins))
        subprocess.run(["podman", "build", "--isolation", "chroot", "-t", tag, "-f", str(work / "Containerfile"),
                        str(work)], check=True, capture_output=True, text=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return tag


def wheel_version(wheels: Path, name: str) -> str:
    (wheel,) = wheels.glob(f"{name}-*.whl")
    return wheel.name.split("-")[1]


def real_build(tmp_path: Path, cfg: Config) -> str:
    """Build `cfg` for real (no import); its log."""
    console = Console(file=open(tmp_path / "console.txt", "w"), width=400)
    root = copy_sources(tmp_path / "src")
    owner = own_project(root, "real-build-pins")
    try:
        result = build_image(cfg, root=root, do_import=False, console=console)
    finally:
        console.file.close()
        untag_own(owner, f"localhost/{cfg.image.name}")
    assert result.built
    return result.plan.log.read_text()


@pytest.mark.podman
def test_real_build_resolves_against_the_bases_pins_and_installs_what_the_run_needs(tmp_path: Path):
    """A base that pins fsspec and pyyaml to what fits: kept. train.float8 on: torchao in the image.
    launch.preset alps-gh200 with torchrun: numactl installed (the base has none), and it runs."""
    reason = _podman_ok()
    if reason:
        pytest.skip(reason)
    wheels = ensure_wheelhouse()
    fsspec, pyyaml = wheel_version(wheels, "fsspec"), wheel_version(wheels, "pyyaml")
    base = ensure_pinned_base([f"fsspec=={fsspec}", f"PyYAML=={pyyaml}"])
    checks = ("python3 -m trainer.smoke && python3 -c 'import fsspec, torchao; print(\"checked fsspec\", "
              "fsspec.__version__, \"torchao\", torchao.__version__)' && numactl --show > /dev/null && "
              f"echo numactl runs  # {uuid.uuid4().hex[:8]}")
    cfg = make_cfg(name="slipway-pintest", base_image=base, flash_attn=False, isolation="chroot",
                   wheelhouse=str(wheels), output_dir=str(tmp_path / "images"), build_args={"SMOKE": checks})
    cfg.train.float8 = True
    cfg.launch.preset, cfg.launch.launcher = "alps-gh200", "torchrun"
    log = real_build(tmp_path, cfg)
    assert "pip_requirements: resolving against the base's 2 pins (/etc/pip/constraint.txt)" in log
    assert "(extras trainer, plot, float8; the image has no torch: installing one)" in log
    assert "numactl: installed (" in log, log[-3000:]
    assert re.search(rf"^checked fsspec {re.escape(fsspec)} torchao \d", log, re.M), log[-3000:]
    assert "numactl runs" in log and "smoke ok" in log


@pytest.mark.podman
def test_real_build_stops_at_a_conflicting_pin_in_one_line_and_lifting_it_builds(tmp_path: Path):
    reason = _podman_ok()
    if reason:
        pytest.skip(reason)
    wheels = ensure_wheelhouse()
    base = ensure_pinned_base(["fsspec==2021.4.0"])  # older than datasets allows
    old = CACHE / "old-fsspec"  # the pinned version, as an index would offer it
    if not list(old.glob("fsspec-2021.4.0-*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "-d", str(old), "fsspec==2021.4.0"], check=True)
    wheels = wheelhouse_with(tmp_path, *old.glob("fsspec-2021.4.0-*.whl"))
    cfg = make_cfg(name="slipway-pintest", base_image=base, flash_attn=False, isolation="chroot",
                   wheelhouse=str(wheels), output_dir=str(tmp_path / "images"))
    (tmp_path / "a").mkdir()
    t0 = time.monotonic()
    with pytest.raises(ToolError) as exc:
        real_build(tmp_path / "a", cfg)
    message = str(exc.value)
    assert "\n" not in message
    assert re.match(r"^podman build failed at the dependencies step \(STEP \d+/\d+\) \(exit 1\): dependencies "
                    r"FAILED: the base image pins fsspec==2021\.4\.0 in its pip constraints \(/etc/pip/constraint\.txt"
                    r", PIP_CONSTRAINT\), but datasets \S+ needs fsspec.*: set image\.build_args\.PIP_CONSTRAINT_LIFT: "
                    r"\"fsspec\" to lift that pin", message), message
    assert time.monotonic() - t0 < 600
    cfg.image.build_args = {"PIP_CONSTRAINT_LIFT": "fsspec"}
    (tmp_path / "b").mkdir()
    log = real_build(tmp_path / "b", cfg)
    assert "pip_requirements: lifting the base's pins fsspec==2021.4.0 for slipway's dependencies" in log
    assert "smoke ok" in log


@pytest.mark.podman
def test_real_build_compiles_flash_attn_for_the_nodes_architecture(tmp_path: Path):
    """A CUDA base without flash-attn and no wheel for it: the build compiles for 90 (H100, GH200) and
    says so (offline, the source is missing, so the compile itself stops at pip, diagnosed)."""
    reason = _podman_ok()
    if reason:
        pytest.skip(reason)
    wheels = ensure_wheelhouse()
    ensure_cuda_standin_base(CUDA_STANDIN_BASE, wheels)
    cfg = make_cfg(name="slipway-flashtest", base_image=CUDA_STANDIN_BASE, flash_attn=True, isolation="chroot",
                   wheelhouse=str(wheels), output_dir=str(tmp_path / "images"))
    with pytest.raises(ToolError) as exc:
        real_build(tmp_path, cfg)
    log = next((tmp_path / "images" / "logs").glob("*.log")).read_text()
    said = ("flash-attn: compiling 2.8.3 because the base has no flash-attn and no wheel in the wheelhouse fits, "
            "for CUDA architectures 90 (H100, GH200; image.build_args.FLASH_ATTN_CUDA_ARCHS for others), against "
            "torch 2.13.0+cpu, CUDA 13.1 on ")
    assert said in log, [line for line in log.splitlines() if "flash-attn" in line]
    assert str(exc.value).startswith("podman build failed at the flash-attn step") and \
        "cannot be found in the offline wheelhouse" in str(exc.value), str(exc.value)

