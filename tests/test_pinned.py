"""A run's pinned image through its life: prune keeps what runs pin, submit and doctor refuse a
pinned squashfs that is not there (whatever names it), `doctor RUN` checks a run, `shell` works
before any run and checks its mount sources before srun, and a submission runs the build of its
image settings (not the latest), or names what differs and the command that builds it.

Through the command line, with real files: the squashfs stand-ins and build records are written
through the image module itself (as tests/test_sealed.py does); only podman and enroot are skipped.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tree
from containers.project import Project
from containers.record import BuildRecord
from image_standins import calls, write_standins
from test_sealed import one_line_error, slurm_stand_ins, stand_in  # noqa: F401  (a fixture)

PY = sys.executable
PYXIS = ["container.runtime=pyxis"]


def slipway(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "jobs", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "400", **(env or {})})


@pytest.fixture
def pin_config(project: Path) -> str:
    """configs/pin.yaml: tiny_cpu with its images in the project, which holds the Dockerfile: the
    checkout submit and `slipway image` build from."""
    text = (project / "configs" / "tiny_cpu.yaml").read_text()
    (project / "configs" / "pin.yaml").write_text(
        text + f"\nimage:\n  output_dir: {json.dumps(str(project / 'images'))}\n")
    (project / "containers").mkdir(exist_ok=True)
    (project / "containers" / "Dockerfile").write_text(
        (Path(__file__).resolve().parents[1] / "containers" / "Dockerfile").read_text())
    return "pin"


def fake_build(project: Path, *overrides: str, source: str | None = None) -> Path:
    """What `slipway image build pin OVERRIDES` leaves (record, content-addressed squashfs, the link),
    written through the image module; `source` changes a file of the build context first."""
    from containers.image import make_current, build_record, image_plan
    from jobs.config import load_config

    if source is not None:
        (project / "configs" / "extra.yaml").write_text(f"# {source}\n")
    cwd = os.getcwd()
    os.chdir(project)
    try:
        plan = image_plan(load_config("pin", list(overrides)), root=project, enroot_mount=False, git=False)
    finally:
        os.chdir(cwd)
    plan.output_dir.mkdir(parents=True, exist_ok=True)
    plan.squashfs.write_bytes(b"hsqs" + plan.hash.encode() * 100)
    record = build_record(plan, image_id=None, enroot_version="stand-in")
    plan.sidecar.write_text(record.to_json())
    make_current(plan, record)
    return plan.squashfs


def submit(run: str, *args: str, env: dict) -> dict:
    r = slipway("submit", "pin", *PYXIS, "--run-name", run, *args, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads((Path.cwd() / "runs" / run / "manifest.json").read_text())


# ------------------------------------------------------------------ prune


@pytest.mark.slow
def test_prune_keeps_what_runs_pin_and_removes_the_rest(project, pin_config, slurm_stand_ins, tmp_path):
    pinned = fake_build(project, source="1")
    manifest = submit("old", env=slurm_stand_ins)
    assert manifest["image"]["path"] == str(pinned) == manifest["submissions"][0]["image"]["path"]
    unpinned = fake_build(project, source="2")
    current = fake_build(project, source="3")
    assert len({pinned, unpinned, current}) == 3

    # The podman stand-in (tests/image_standins.py) holds each build's tag, labelled with the
    # project: the pinned one's stays too.
    bin_dir = write_standins(tmp_path / "bin", "podman")
    podman = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    tags = {p: BuildRecord.beside(p).tag for p in (pinned, unpinned, current)}
    label = f"slipway.project={Project.of(project).id}"
    for tag in tags.values():
        subprocess.run([str(bin_dir / "podman"), "build", "-t", tag, "--label", label, str(tmp_path)], check=True,
                       capture_output=True)
    r = slipway("image", "prune", pin_config, env=podman)
    assert r.returncode == 0, r.stdout + r.stderr
    untagged = [c["argv"][2] for c in calls(bin_dir, "podman") if c["argv"][1] == "rmi"]
    assert untagged == [tags[unpinned]], untagged
    assert not unpinned.exists() and not unpinned.with_suffix(".json").exists()
    assert pinned.exists() and pinned.with_suffix(".json").exists() and current.exists()
    assert f"removed {unpinned}" in r.stdout
    assert f"kept {pinned}: pinned by run old" in r.stdout
    assert f"kept {current}: the current image" in r.stdout

    # Runs are found under $SLIPWAY_RUNS when it is set: elsewhere, the pin is not seen.
    again = slipway("image", "prune", pin_config, env={**podman, "SLIPWAY_RUNS": str(project / "elsewhere")})
    assert again.returncode == 0 and not pinned.exists(), again.stdout
    pinned.write_bytes(b"hsqs")  # back, for the explicit removal below

    # Named explicitly, a pinned image goes (with its record); the current one never.
    r = slipway("image", "prune", pin_config, "--remove", str(current), env=podman)
    assert "is the current image" in one_line_error(r, "--remove") and current.exists()
    r = slipway("image", "prune", pin_config, "--remove", str(pinned), env=podman)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not pinned.exists() and f"removed {pinned}" in r.stdout and current.exists()


def test_prune_removes_nothing_while_a_runs_manifest_is_damaged(project, pin_config, slurm_stand_ins):
    """A manifest that cannot be read may pin any image: one line naming it, exit 2, nothing removed."""
    pinned = fake_build(project, source="1")
    submit("old", env=slurm_stand_ins)
    unpinned = fake_build(project, source="2")
    fake_build(project, source="3")
    manifest = project / "runs" / "old" / "manifest.json"
    manifest.write_text('{"run": "old", "submissions": [{"job_id": 7}]}')
    before = tree(project / "images")
    r = slipway("image", "prune", pin_config)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.stdout, r.stderr)
    assert lines[0].startswith(f"slipway: error: {manifest}: damaged (submissions[0].job_id: expected str or null, got 7")
    assert "it may pin an image, so nothing was pruned" in lines[0] and "prune again" in lines[0]
    assert tree(project / "images") == before and pinned.exists() and unpinned.exists()


# ------------------------------------------------------------------ a pinned squashfs that is not there


@pytest.mark.slow
def test_submit_and_doctor_refuse_a_missing_squashfs_whatever_names_it(project, tmp_path, slurm_stand_ins):
    gone = project / "images" / "gone.sqsh"
    edf_dir = tmp_path / "edfs"
    edf_dir.mkdir()
    (edf_dir / "site.toml").write_text(f"image = {json.dumps(str(gone))}\n")
    env = {**slurm_stand_ins, "EDF_PATH": str(edf_dir)}
    for field, args in (("container.image", [*PYXIS, f"container.image={gone}"]),
                        ("container.base_environment[0]", ["container.runtime=edf",
                                                           "container.base_environment=[site]"])):
        before = tree(project)
        r = slipway("submit", "tiny_cpu", *args, "--run-name", "x", env=env)
        assert str(gone) in one_line_error(r, field)
        assert tree(project) == before
        r = slipway("submit", "tiny_cpu", *args, "--dry-run", env=env)
        assert r.returncode == 2 and f"\n  - {field}: " in r.stdout, r.stdout
        r = slipway("doctor", "tiny_cpu", *args, env=env)
        (line,) = [line for line in r.stdout.splitlines() if line.startswith("fail image:")]
        assert r.returncode == 1 and f"fail image: {field}: " in line and str(gone) in line, r.stdout
    # The same EDF naming a squashfs that is there pins it.
    gone.parent.mkdir(parents=True)
    gone.write_bytes(b"hsqs")
    r = slipway("submit", "tiny_cpu", "container.runtime=edf", "container.base_environment=[site]", "--run-name",
                "b", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads((project / "runs" / "b" / "manifest.json").read_text())["image"]["path"] == str(gone)


def test_a_users_squashfs_is_read_once_per_version_not_at_each_launch(project, tmp_path, slurm_stand_ins):
    """A squashfs slipway did not build is pinned by its bytes' sha256: read at its first launch
    and remembered in the user's cache by what any write changes, so a dev loop on a 20 GB image
    does not read 20 GB a launch; changed in place (same size, its mtime set back) it is read again;
    a damaged, foreign or unwritable cache is read past."""
    import hashlib

    image = tmp_path / "own.sqsh"
    image.write_bytes(b"hsqs" + os.urandom(1 << 20))
    cache = tmp_path / "cache"
    env = {**slurm_stand_ins, "XDG_CACHE_HOME": str(cache)}

    def pinned(name: str, **more: str) -> str:
        r = slipway("submit", "tiny_cpu", *PYXIS, f"container.image={image}", "--run-name", name, env={**env, **more})
        assert r.returncode == 0, r.stderr
        return json.loads((project / "runs" / name / "manifest.json").read_text())["image"]["sha256"]

    assert pinned("a") == hashlib.sha256(image.read_bytes()).hexdigest()
    remembered = cache / "slipway" / "image-digests.json"
    (key, digest), = json.loads(remembered.read_text()).items()
    remembered.write_text(json.dumps({key: "0" * 64}))  # what the cache says is what a launch uses: not read
    assert pinned("b") == "0" * 64
    st = image.stat()
    image.write_bytes(b"hsqs" + os.urandom(1 << 20))  # the same size, its mtime set back: the change time tells
    os.utime(image, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert pinned("c") == hashlib.sha256(image.read_bytes()).hexdigest() != digest
    assert len(json.loads(remembered.read_text())) == 1  # the old version's entry replaced
    for damaged in (b"[1, 2]", b"{\"k\": 3", b"\xff\xfe", b" " * (2 << 20) + b"{}"):
        remembered.write_bytes(damaged)
        assert pinned(f"d{len(damaged)}") == hashlib.sha256(image.read_bytes()).hexdigest()
    remembered.unlink()
    os.mkfifo(remembered)  # never opened to wait on a writer; replaced by the next write
    assert pinned("fifo") == hashlib.sha256(image.read_bytes()).hexdigest() and remembered.is_file()
    assert pinned("e", XDG_CACHE_HOME="/proc/no-such-cache") == hashlib.sha256(image.read_bytes()).hexdigest()


# ------------------------------------------------------------------ doctor RUN


@pytest.mark.slow
def test_doctor_of_a_run_says_its_pinned_image_is_gone(project, pin_config, slurm_stand_ins):
    pinned = fake_build(project, source="1")
    submit("kept", env=slurm_stand_ins)
    r = slipway("doctor", "--run", "kept")
    assert r.returncode == 0, r.stdout
    assert f"ok   pinned image: {pinned} (" in r.stdout and "as recorded" in r.stdout
    assert "ok   run config:" in r.stdout and "ok   mount sources:" in r.stdout

    pinned.unlink()
    # A bare name that is a run and no config is the run.
    for args in (["kept"], ["--run", "kept"]):
        r = slipway("doctor", *args)
        assert r.returncode == 1, r.stdout
        (line,) = [line for line in r.stdout.splitlines() if line.startswith("fail")]
        assert line.startswith(f"fail pinned image: {pinned} is gone") and "slipway image build" in line
    # A config of that name wins; --run and a config together are refused.
    assert "pinned image" not in slipway("doctor", "pin").stdout
    one_line_error(slipway("doctor", "pin", "--run", "kept"), "--run")
    one_line_error(slipway("doctor", "--run", "nope"), "RUN")


@pytest.mark.slow
def test_doctor_of_a_run_names_what_its_config_would_build_now(project, pin_config, slurm_stand_ins):
    pinned = fake_build(project, source="1")
    submit("r", env=slurm_stand_ins)
    (project / "configs" / "extra.yaml").write_text("# changed\n")
    r = slipway("doctor", "r")
    assert r.returncode == 0, r.stdout
    (line,) = [line for line in r.stdout.splitlines() if "current build" in line]
    # Code alone differs: the run's code snapshot brings it, so no rebuild is asked for.
    assert "in code only" in line and "no rebuild needed" in line and pinned.name[8:20] in line
    # What the image installs differs: named, with the command.
    (project / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = ["tomli>=2"]\n')
    r = slipway("doctor", "r")
    (line,) = [line for line in r.stdout.splitlines() if "current build" in line]
    assert "the dependencies (pyproject.toml) changed" in line and "sources" not in line, line
    assert "slipway image build" in line

    # A mount source removed since submission: the next job would not start (on a build of today's settings).
    fake_build(project)
    mounted = project / "data"
    mounted.mkdir()
    submit("m", f"container.mounts=[{mounted}:/data]", env=slurm_stand_ins)
    mounted.rmdir()
    r = slipway("doctor", "m")
    assert r.returncode == 1 and f"fail mount sources: {mounted} missing" in r.stdout, r.stdout


# ------------------------------------------------------------------ shell


def test_shell_before_any_run_mounts_nothing_missing_and_says_so(project):
    img = project / "img.sqsh"
    img.write_bytes(b"hsqs")
    before = tree(project)
    r = slipway("shell", "tiny_cpu", *PYXIS, f"container.image={img}", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert tree(project) == before
    run_dir = project / "runs" / "tiny_cpu"
    words = shlex.split(r.stdout)
    code = next(w for w in words if w.startswith("SLIPWAY_CODE=")).split("=", 1)[1]
    # Only the code snapshot, which the shell writes when it starts (the dry run says so, writing nothing).
    assert [w for w in words if w.startswith("--container-mounts=")] == [f"--container-mounts={code}:{code}:ro"]
    assert f"the code snapshot {code} (written when the shell starts)" in r.stderr
    assert f"note: not mounted in the shell: the run directory {run_dir} does not exist yet" in r.stderr
    assert f"data.cache_dir (the token cache) {project / '.cache' / 'tokens'} does not exist yet" in r.stderr
    # Once it exists (a submission made it), the shell mounts it.
    run_dir.mkdir(parents=True)
    r = slipway("shell", "tiny_cpu", *PYXIS, f"container.image={img}", "--dry-run")
    assert f"--container-mounts={run_dir}:{run_dir},{code}:{code}:ro" in shlex.split(r.stdout)
    assert "the run directory" not in r.stderr


def test_a_missing_mount_source_is_refused_before_srun(project, tmp_path):
    img = project / "img.sqsh"
    img.write_bytes(b"hsqs")
    bin_dir, ran = tmp_path / "bin", tmp_path / "srun-ran"
    stand_in(bin_dir, "srun", f'printf "%s\\n" "$@" > {shlex.quote(str(ran))}\n')
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    scratch = project / "scratch"
    base = [*PYXIS, f"container.image={img}", f"container.mounts=[{scratch}:/scratch]", "--command", "true"]
    r = slipway("shell", "tiny_cpu", *base, env=env)
    assert str(scratch) in one_line_error(r, "container.mounts[0]") and not ran.exists()
    # A base environment's mount the same way, named by its entry.
    edf_dir = tmp_path / "edfs"
    edf_dir.mkdir()
    (edf_dir / "site.toml").write_text(f"mounts = [{json.dumps(str(tmp_path / 'nope') + ':/nope')}]\n")
    r = slipway("shell", "tiny_cpu", *PYXIS, f"container.image={img}", "container.base_environment=[site]",
                "--command", "true", env={**env, "EDF_PATH": str(edf_dir)})
    assert str(tmp_path / "nope") in one_line_error(r, "container.base_environment[0]") and not ran.exists()
    # With the source there, srun runs.
    scratch.mkdir()
    r = slipway("shell", "tiny_cpu", *base, env=env)
    assert r.returncode == 0, r.stderr
    mounts = next(line for line in ran.read_text().splitlines() if line.startswith("--container-mounts="))
    assert mounts.startswith(f"--container-mounts={scratch}:/scratch,"), mounts  # then the code snapshot


# ------------------------------------------------------------------ the build of the config's settings


def _pinned_by_dry_run(pin_config: str, *args: str) -> str:
    r = slipway("submit", pin_config, *PYXIS, *args, "--dry-run")
    assert r.returncode == 0, r.stderr
    return r.stdout + r.stderr


@pytest.mark.slow
def test_a_submission_runs_the_build_of_its_image_settings_not_the_latest(project, pin_config, slurm_stand_ins):
    with_flash = fake_build(project)  # the config's defaults: flash-attn on
    without = fake_build(project, "image.flash_attn=false")  # built last: the current image
    assert with_flash.name in _pinned_by_dry_run(pin_config)
    assert without.name in _pinned_by_dry_run(pin_config, "image.flash_attn=false")
    # Through a real submission, the manifest pins the build of the settings.
    manifest = submit("variant", env=slurm_stand_ins)
    assert manifest["image"]["path"] == str(with_flash.resolve())

    # A code change needs no rebuild: the run's code snapshot brings it.
    (project / "configs" / "extra.yaml").write_text("# new\n")
    assert with_flash.name in _pinned_by_dry_run(pin_config)

    # Settings no build has: one line, what differs from the closest build and the command that builds
    # exactly that (the user's image overrides, nothing else); doctor says the same.
    r = slipway("submit", pin_config, *PYXIS, "image.base_image=localhost/other:1", "--seed", "7",
                "--run-name", "other", env=slurm_stand_ins)
    line = one_line_error(r, "container.image")
    assert "no image is built for this config's image settings" in line
    assert "image.base_image 'nvcr.io/nvidia/pytorch:25.12-py3' -> 'localhost/other:1'" in line
    assert "flash_attn" not in line and "sources" not in line
    command = line.split("`")[1]
    assert shlex.split(command) == ["slipway", "image", "build", "pin", "image.base_image=localhost/other:1"]
    assert not (project / "runs" / "other").exists()
    r = slipway("doctor", pin_config, *PYXIS, "image.base_image=localhost/other:1")
    assert r.returncode != 0 and "no image is built for this config's image settings" in r.stdout, r.stdout

    # Without a snapshot the job runs the image's code: a build of other sources is not that build.
    r = slipway("submit", pin_config, *PYXIS, "image.flash_attn=false", "code.snapshot=false", env=slurm_stand_ins)
    line = one_line_error(r, "container.image")
    assert "sources changed in configs/" in line and "flash_attn true" not in line
    assert line.split("`")[1] == "slipway image build pin image.flash_attn=false"


def test_doctor_of_a_run_checks_its_code_and_job_library_as_the_nodes_will(project, pin_config, slurm_stand_ins):
    fake_build(project)
    manifest = submit("sealed", env=slurm_stand_ins)
    assert manifest["job_lib"] and all(name.startswith("lib/") for name in manifest["job_lib"])
    assert manifest["submissions"][-1]["job_lib"] == manifest["job_lib"]
    r = slipway("doctor", "--run", "sealed")
    assert r.returncode == 0, r.stdout
    assert "ok   pinned code: snapshot" in r.stdout and "ok   job library: lib/job_lib-" in r.stdout
    code = Path(manifest["code"]["dir"])
    model = code / "trainer" / "model.py"
    model.chmod(0o644)
    model.write_text("# edited in the store\n")
    lib = project / "runs" / "sealed" / next(iter(manifest["job_lib"]))
    lib.chmod(0o644)
    lib.write_text(lib.read_text() + "\n# edited\n")
    r = slipway("doctor", "--run", "sealed")
    assert r.returncode == 1, r.stdout
    assert f"fail pinned code: {model} differs from the file submitted: the next job would end at its start" in r.stdout
    assert f"fail job library: {lib} differs from the one submitted" in r.stdout
