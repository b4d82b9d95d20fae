"""The training image: content hash, command lines, atomic import, prune, and a real podman build.

Fast tests run the image code against stand-ins for podman, enroot and srun
(tests/image_standins.py) that record their command lines. The `podman` test
builds containers/Dockerfile for real on a small Debian base made here with
mmdebstrap, installs from a wheelhouse downloaded on the host, and runs the
smoke test inside the build.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from containers import context as ctx
from containers import image as img
from containers.image import (
    ImagePlan,
    build_image,
    check_free_space,
    context_files,
    current_image,
    image_plan,
    prune_images,
    resolve_image,
)
from containers.pip_requirements import requirements, toml_loads
from containers.storage import check_storage_conf, filesystem_type
from containers.tools import Podman, ToolError
from jobs.config import Config, ImageSection, load_config
from tests.image_standins import calls, write_standins
from trainer.config import ConfigError

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


@pytest.fixture
def fakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """podman, enroot and srun stand-ins first on PATH."""
    bin_dir = write_standins(tmp_path / "bin", "podman", "enroot", "srun")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("FAKE_ENROOT_MOUNT", raising=False)
    monkeypatch.delenv("FAKE_ENROOT_MODE", raising=False)
    monkeypatch.setenv("ENROOT_TEMP_PATH", str(tmp_path))
    return bin_dir


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
    assert base.tag == f"localhost/slipway:{base.hash[:12]}"
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
    assert changed(build_args={"MAX_JOBS": "4"}) != base.hash
    assert changed(base_image=TEST_BASE) != base.hash
    assert changed(flash_attn=False) != base.hash
    assert changed(squash_options="-comp lz4") != base.hash

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
    args = ["--build-arg", f"BASE_IMAGE={TEST_BASE}", "--build-arg", "FLASH_ATTN=0", "--build-arg", "WHEELHOUSE=",
            "--build-arg", "WHEELHOUSE_DIGEST=", "--build-arg", f"SLIPWAY_VERSION={ctx.project_version(project)}",
            "--build-arg", "MAX_JOBS=4", "--build-arg", "GIT_COMMIT=unknown"]
    assert plan.podman_argv == ["podman", "build", "-f", str(project / "containers" / "Dockerfile"),
                                "-t", f"localhost/slipway:{h12}", *args, "--network=host", "--isolation=chroot",
                                str(out / f".context-{h12}")]
    # Upstream enroot: no -x mount. ENROOT_SQUASH_OPTIONS from image.squash_options.
    temp = out / f".slipway-{h12}.sqsh.tmp-{img._host()}-{os.getpid()}"
    assert plan.enroot_argv == ["enroot", "import", "-o", str(temp), f"podman://localhost/slipway:{h12}"]
    assert plan.enroot_env == {"ENROOT_SQUASH_OPTIONS": "-comp zstd -Xcompression-level 3 -b 1M"}
    assert not plan.enroot_mount and plan.srun_argv is None
    # CSCS's enroot lists -x in `enroot import --help`: detected, not assumed.
    monkeypatch.setenv("FAKE_ENROOT_MOUNT", "1")
    cscs = image_plan(cfg, root=project)
    assert cscs.enroot_argv == ["enroot", "import", "-x", "mount", "-o", str(temp), f"podman://localhost/slipway:{h12}"]
    assert calls(fakes, "enroot")[-1]["argv"] == ["enroot", "import", "--help"]
    # --force rebuilds without the layer cache.
    assert image_plan(cfg, root=project, force=True, enroot_mount=False).podman_argv[-2] == "--no-cache"


def test_compute_build_command_line_and_run(project: Path, fakes: Path):
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml",
                      ["image.build_on=compute", "slurm.partition=debug", "slurm.account=a-07",
                       "slurm.time=00:45:00", f"image.base_image={TEST_BASE}"])
    plan = image_plan(cfg, root=project, enroot_mount=False, force=True)
    frozen = project / "images" / f".build-{plan.hash[:12]}.yaml"
    assert plan.srun_argv == ["srun", "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=00:45:00",
                              "--account=a-07", "--partition=debug", "--job-name=slipway-image",
                              sys.executable, "-m", "containers", "build", "--here", str(frozen), "--force"]
    # Through the srun stand-in the inner build runs the podman and enroot stand-ins.
    result = build_image(cfg, root=project, force=True)
    argvs = [c["argv"] for c in calls(fakes)]
    assert [c["argv"] for c in calls(fakes, "srun")] == [plan.srun_argv]
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
    stale = out / f".{plan.squashfs.name}.tmp-{img._host()}-999999999"
    stale.write_bytes(b"half")
    result = build_image(cfg, root=project)
    assert result.built and result.imported and result.squashfs == plan.squashfs
    assert plan.squashfs.read_bytes().startswith(b"hsqs")
    assert not stale.exists() and not list(out.glob(".*.tmp-*")) and not list(out.glob(".context-*"))
    (enroot_call,) = [c for c in calls(fakes, "enroot") if c["argv"][1] == "import" and "--help" not in c["argv"]]
    assert enroot_call["argv"] == plan.enroot_argv  # written under the temp name, renamed after
    assert enroot_call["squash"] == "-comp zstd -Xcompression-level 3 -b 1M"
    podman_build = [c["argv"] for c in calls(fakes, "podman") if c["argv"][1] == "build"]
    assert podman_build == [plan.podman_argv]
    # The record, the sidecar and the stable link.
    record = current_image(cfg, root=project)
    assert record == json.loads(plan.sidecar.read_text())
    assert record["hash"] == plan.hash and record["tag"] == plan.tag
    assert record["squashfs"] == str(plan.squashfs) and record["base_image"] == TEST_BASE
    assert record["size_bytes"] == plan.squashfs.stat().st_size and record["enroot_version"] == "3.5.0"
    assert plan.link.is_symlink() and os.readlink(plan.link) == plan.squashfs.name
    assert resolve_image(cfg, root=project) == plan.squashfs
    assert "STEP 2/2" in plan.log.read_text()


def test_noop_build_does_not_call_podman(project: Path, fakes: Path):
    cfg = make_cfg(base_image=TEST_BASE, flash_attn=False)
    first = build_image(cfg, root=project)
    n_podman = len(calls(fakes, "podman"))
    t0 = time.perf_counter()
    again = build_image(cfg, root=project)
    elapsed = time.perf_counter() - t0
    assert not again.built and not again.imported and again.squashfs == first.squashfs
    assert len(calls(fakes, "podman")) == n_podman
    assert elapsed < 1.0, f"no-op build took {elapsed:.2f} s"

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
    assert current_image(cfg, root=project)["hash"] == first.plan.hash
    assert len(calls(fakes, "podman")) == n_podman


def test_failed_import_leaves_no_file(project: Path, fakes: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FAKE_ENROOT_MODE", "fail")
    cfg = make_cfg(base_image=TEST_BASE)
    with pytest.raises(ToolError, match=r"enroot import failed \(exit 1\).*podman image localhost/slipway:"):
        build_image(cfg, root=project)
    out = project / "images"
    assert not list(out.glob("*.sqsh")) and not list(out.glob(".*.tmp-*"))
    assert current_image(cfg, root=project) is None
    # The retry imports without rebuilding (the podman tag exists).
    monkeypatch.setenv("FAKE_ENROOT_MODE", "ok")
    result = build_image(cfg, root=project)
    assert not result.built and result.imported and result.squashfs.is_file()


def test_interrupted_import_leaves_no_file(project: Path, fakes: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FAKE_ENROOT_MODE", "hang")
    out = project / "images"
    proc = subprocess.Popen([sys.executable, "-m", "containers", "build", "configs/tiny_cpu.yaml"], cwd=project,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 30
    while not list(out.glob(".slipway-*.sqsh.tmp-*")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert list(out.glob(".slipway-*.sqsh.tmp-*")), proc.communicate()[0]
    proc.send_signal(signal.SIGINT)  # Ctrl-C while enroot writes
    output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, output
    assert not list(out.glob("*.sqsh")) and not list(out.glob(".*.tmp-*")) and not list(out.glob(".context-*"))


@pytest.mark.skipif(not (shutil.which("mksquashfs") and shutil.which("unsquashfs")), reason="needs squashfs-tools")
def test_whole_squashfs_kept_when_enroot_exits_nonzero(project: Path, fakes: Path,
                                                       monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FAKE_ENROOT_MODE", "exit127")
    result = build_image(make_cfg(), root=project)
    assert result.imported and result.squashfs.is_file()
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
        build_image(make_cfg(build_on="compute"), root=project)


def test_base_that_cannot_be_pulled(project: Path, fakes: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FAKE_PODMAN_FAIL", "pull")
    with pytest.raises(ToolError, match=r"podman could not pull the base image nvcr.io/nvidia/pytorch:25.01-py3: "
                                        r".*no such host.*image.network_host"):
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


def test_prune_keeps_the_current_image(project: Path, fakes: Path):
    cfg = make_cfg()
    made = []
    for i in range(3):
        (project / "configs" / "v.yaml").write_text(f"run: {{seed: {i}}}\n")
        made.append(build_image(cfg, root=project).squashfs)
        os.utime(made[-1], (time.time() - 100 + i, time.time() - 100 + i))
    # Make the oldest current again (back to its sources): the two others go with keep=1.
    (project / "configs" / "v.yaml").write_text("run: {seed: 0}\n")
    assert build_image(cfg, root=project).squashfs == made[0]
    assert len(list((project / "images").glob("slipway-*.sqsh"))) == 3
    removed = prune_images(cfg, keep=2, root=project)
    assert made[1] in removed and made[1].with_suffix(".json") in removed
    assert made[0].exists() and made[2].exists() and not made[1].exists()
    removed = prune_images(cfg, keep=1, root=project)
    assert made[2] in removed and made[0].exists()
    assert resolve_image(cfg, root=project) == made[0]
    tags = [c["argv"][2] for c in calls(fakes, "podman") if c["argv"][1] == "rmi"]
    assert sorted(tags) == sorted(f"localhost/slipway:{p.name[8:20]}" for p in made[1:])
    assert prune_images(cfg, keep=1, root=project) == []
    with pytest.raises(ConfigError, match="--keep"):
        prune_images(cfg, keep=0, root=project)


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
    assert bad[0].line().startswith("FAIL podman graphroot /capstor/scratch/u/podman is on lustre")
    assert filesystem_type(Path("/capstor/scratch/new/dir"), mounts) == "lustre"
    conf.write_text("[storage\n")
    assert not check_storage_conf(conf, mounts)[0].ok


def test_pip_requirements_keep_the_images_torch(tmp_path: Path):
    project = toml_loads((REPO / "pyproject.toml").read_text())
    with_torch = requirements(project, have_torch=True)
    without = requirements(project, have_torch=False)
    assert [r for r in without if r.startswith("torch")] == ["torch>=2.6"]
    assert not [r for r in with_torch if r.split(">")[0].split("=")[0].strip() == "torch"]
    assert set(without) - set(with_torch) == {"torch>=2.6"}
    assert "pyyaml>=6.0" in with_torch  # the runtime deps come along (trainer.config reads YAML)
    # The script as the Dockerfile runs it, here where torch is installed.
    out = subprocess.run([sys.executable, str(REPO / "containers" / "pip_requirements.py"), str(REPO / "pyproject.toml"),
                          str(tmp_path / "r.txt"), str(tmp_path / "c.txt")], capture_output=True, text=True, check=True)
    assert "keeping the image's torch" in out.stdout
    assert (tmp_path / "c.txt").read_text().startswith("torch==")
    assert "torch" not in (tmp_path / "r.txt").read_text().replace("tomli-w", "")


def test_dockerfile_contract():
    text = (REPO / "containers" / "Dockerfile").read_text()
    assert f"ARG BASE_IMAGE={ImageSection().base_image}\n" in text  # in sync with the config default
    assert "pip install --no-build-isolation" in text and 'flash-attn==$FLASH_ATTN_VERSION' in text
    assert "ARG FLASH_ATTN=1" in text and "--no-deps" in text
    assert 'CMD ["bash"]' in text and "org.opencontainers.image.revision" in text
    order = [text.index(s) for s in ("flash-attn==", "COPY src/pyproject.toml", "pip install -r requirements.txt",
                                     "COPY src/ /opt/slipway/", "sh -c \"$SMOKE\"", "ARG GIT_COMMIT")]
    assert order == sorted(order), "layers must run from rarely to often changed"


def test_cli_show(project: Path, fakes: Path):
    out = subprocess.run([sys.executable, "-m", "containers", "show", "configs/tiny_cpu.yaml"], cwd=project,
                         capture_output=True, text=True, env={**os.environ, "COLUMNS": "300"})
    assert out.returncode == 0, out.stderr
    plan = image_plan(load_config(project / "configs" / "tiny_cpu.yaml"), root=project, enroot_mount=False)
    assert f"tag       {plan.tag}" in out.stdout and "(not built)" in out.stdout
    assert "ENROOT_SQUASH_OPTIONS='-comp zstd -Xcompression-level 3 -b 1M' enroot import -o" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "containers", "build", "configs/tiny_cpu.yaml", "image.name=Bad Name"],
                         cwd=project, capture_output=True, text=True)
    assert bad.returncode == 2 and "image.name" in bad.stderr


# ---------------------------------------------------------------- a real podman build


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
    reqs = requirements(toml_loads((REPO / "pyproject.toml").read_text()), have_torch=False)
    # The CPU torch this machine has as a wheel (the image installs whatever satisfies torch>=2.6 here).
    reqs = ["torch==2.13.0" if r.startswith("torch") else r for r in reqs]
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
        assert result.built and result.imported and result.squashfs.is_file()
        log = result.plan.log.read_text()
        assert "smoke ok" in log
        reqs = subprocess.run(["unsquashfs", "-cat", str(result.squashfs), "opt/slipway/deps/requirements.txt"],
                              capture_output=True, text=True, check=True).stdout
        assert "torch>=2.6" in reqs.split()  # this base has no torch: one was installed from the wheelhouse
        listing = subprocess.run(["unsquashfs", "-l", str(result.squashfs)], capture_output=True, text=True).stdout
        site = "/usr/local/lib/python3.11/dist-packages"
        assert f"{site}/trainer/__init__.py" in listing and f"{site}/torch/__init__.py" in listing
        assert "/opt/slipway/configs/tiny_cpu.yaml" in listing

        # Nothing changed: no podman at all, back in well under a second or two.
        write_standins(tmp_path / "nopodman", "podman-forbidden")
        monkeypatch.setenv("PATH", f"{tmp_path / 'nopodman'}{os.pathsep}{os.environ['PATH']}")
        t1 = time.perf_counter()
        again = build_image(cfg, root=root)
        noop_s = time.perf_counter() - t1
        assert not again.built and again.squashfs == result.squashfs
        assert calls(tmp_path / "nopodman") == []
        assert noop_s < 2.0
        t = result.timings
        print(f"\n[real podman build] {build_s:.1f} s: build {t['build']:.1f} s ({log.count('Using cache')} steps "
              f"cached), import {t['import']:.1f} s, squashfs {img.human(result.size)}; no-op {noop_s * 1000:.0f} ms; "
              f"smoke: {smoke!r}")
    finally:
        # Keep this run's tag only: it holds podman's layer cache for the next run (removing the
        # last tag of a chain removes its cached layers too).
        for old in Podman(podman).tags("localhost/slipway-test"):
            if old != tag:
                Podman(podman).untag(old)


@pytest.mark.podman
def test_real_build_flash_attn_on_a_cpu_base_fails_clearly(tmp_path: Path):
    reason = _podman_ok()
    if reason:
        pytest.skip(reason)
    ensure_test_base()
    cfg = make_cfg(name="slipway-test", base_image=TEST_BASE, flash_attn=True, isolation="chroot",
                   output_dir=str(tmp_path / "images"))
    with pytest.raises(ToolError, match=r"podman build failed at STEP 8/\d+: RUN .*flash-attn needs torch and CUDA "
                                        r"in the base image: build with FLASH_ATTN=0 \(image.flash_attn: false\)"):
        build_image(cfg, root=copy_sources(tmp_path / "src"), do_import=False)
