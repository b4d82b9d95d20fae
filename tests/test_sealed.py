"""Sealed runs: what runs on the nodes is what was built and submitted.

Through the command line as a user types it: the run directory and the job's
paths mounted into the container (up to the exact srun line and EDF), the image
pinned to its content-addressed file, `shell` never writing into a run, time
limits, the requeue limit, a 1024-node host list under pipefail, bash -n at
submission, `edf --check`, `doctor` without a controller, local runs in
`status` and `logs`, Ctrl-C, group-readable run directories.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, SRUN_PASSING_PREFLIGHT, default_signals, squeue_answering, tree

PY = sys.executable


def slipway(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "jobs", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def one_line_error(r: subprocess.CompletedProcess, field: str) -> str:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"slipway: error: {field}"), r.stderr
    return lines[0]


def srun_line(script: str) -> list[str]:
    """The words of the training srun line of a rendered batch script (its assignments first)."""
    lines = script.splitlines()
    i = next(i for i, line in enumerate(lines) if "srun --kill-on-bad-exit=1 --wait=" in line)
    return shlex.split(lines[i].rstrip("\\") + " " + lines[i + 1].rstrip(" &"))


def dry_run_files(r: subprocess.CompletedProcess) -> dict[str, str]:
    """job.sbatch and env.toml as `submit --dry-run` prints them (between its rules)."""
    out, files, name = {}, {}, None
    for line in r.stdout.splitlines(keepends=True):
        if line.startswith("==> ") and line.rstrip().endswith(" <=="):
            name = Path(line[4:].rstrip()[:-4]).name
            files[name] = ""
        elif line.startswith(("note:", "dry run:")):
            name = None
        elif name:
            files[name] += line
    out.update(files)
    return out


def fake_build(project: Path, marker: str = "1") -> Path:
    """What `make image` leaves behind (record, content-addressed squashfs, NAME.sqsh link), written
    through the image module itself; only podman and enroot are skipped (tests/test_image.py runs them)."""
    from containers.image import make_current, build_record, image_plan
    from jobs.config import load_config

    (project / "containers").mkdir(exist_ok=True)
    dockerfile = (ROOT / "containers" / "Dockerfile").read_text()
    (project / "containers" / "Dockerfile").write_text(dockerfile + f"# build {marker}\n")
    cwd = os.getcwd()
    os.chdir(project)
    try:
        cfg = load_config("tiny_cpu")
        plan = image_plan(cfg, root=project, enroot_mount=False, git=False)
    finally:
        os.chdir(cwd)
    plan.output_dir.mkdir(parents=True, exist_ok=True)
    plan.squashfs.write_bytes(b"hsqs" + marker.encode() * 1000)
    record = build_record(plan, image_id=None, enroot_version="stand-in")
    plan.sidecar.write_text(record.to_json())
    make_current(plan, record)
    return plan.squashfs


PYXIS = ["container.runtime=pyxis"]


# ------------------------------------------------------------------ the paths the job uses


def test_run_directory_and_caches_are_mounted_for_pyxis(project):
    img = project / "img.sqsh"
    img.write_bytes(b"hsqs")
    r = slipway("submit", "tiny_cpu", "--dry-run", *PYXIS, f"container.image={img}",
                "container.mounts=[/tmp:/scratch]", "code.snapshot=false")  # the code's mount: test_dev_loop
    assert r.returncode == 0, r.stderr
    words = srun_line(dry_run_files(r)["job.sbatch"])
    run_dir, cache = project / "runs" / "tiny_cpu", project / ".cache"
    mounts = next(w for w in words if w.startswith("--container-mounts=")).split("=", 1)[1]
    tokens, hf = cache / "tokens", cache / "huggingface"
    assert mounts.split(",") == ["/tmp:/scratch", f"{run_dir}:{run_dir}", f"{tokens}:{tokens}", f"{hf}:{hf}"], mounts
    assert f"--container-image={img}" in words
    assert words[-2:] == ["--config", f"{run_dir}/config.yaml"]


def test_edf_mounts_are_written_in_the_documented_form(project):
    img = project / "img.sqsh"
    img.write_bytes(b"hsqs")
    data = project / "corpus dir"
    data.mkdir()
    r = slipway("submit", "tiny_cpu", "--dry-run", "container.runtime=edf", f"container.image={img}",
                "data.dataset=./corpus dir", "launch.hf_home=/tmp/hf", "code.snapshot=false")
    assert r.returncode == 2, r.stderr  # refused (an empty corpus): its files are rendered all the same
    edf = dry_run_files(r)["env.toml"]
    run_dir, cache = project / "runs" / "tiny_cpu", project / ".cache" / "tokens"
    from edf import parse_edf

    env = parse_edf(edf)
    assert [m.spec() for m in env.mounts] == [f"{run_dir}:{run_dir}", f"{cache}:{cache}", "/tmp/hf:/tmp/hf",
                                              f"{data}:{data}:ro"], edf
    assert env.image == str(img)
    assert f'"--environment={run_dir}/env.toml"' in dry_run_files(r)["job.sbatch"] or \
        f"--environment={run_dir}/env.toml" in srun_line(dry_run_files(r)["job.sbatch"])


def test_a_user_mount_that_shows_the_path_is_enough(project):
    img = project / "img.sqsh"
    img.write_bytes(b"hsqs")
    r = slipway("submit", "tiny_cpu", "--dry-run", *PYXIS, f"container.image={img}",
                f"container.mounts=[{project.parent}:{project.parent}]", "code.snapshot=false")
    assert r.returncode == 0, r.stderr
    mounts = next(w for w in srun_line(dry_run_files(r)["job.sbatch"]) if w.startswith("--container-mounts="))
    assert mounts == f"--container-mounts={project.parent}:{project.parent}"
    # read-only is not enough for the run directory: it gets its own writable mount
    r = slipway("submit", "tiny_cpu", "--dry-run", *PYXIS, f"container.image={img}",
                f"container.mounts=[{project}:{project}:ro]")
    mounts = next(w for w in srun_line(dry_run_files(r)["job.sbatch"]) if w.startswith("--container-mounts="))
    assert f"{project / 'runs' / 'tiny_cpu'}:{project / 'runs' / 'tiny_cpu'}" in mounts
    # a later mount over the same place shows something else there: ours is added after it
    r = slipway("submit", "tiny_cpu", "--dry-run", *PYXIS, f"container.image={img}",
                f"container.mounts=[{project}:{project}, /tmp:{project}]")
    mounts = next(w for w in srun_line(dry_run_files(r)["job.sbatch"]) if w.startswith("--container-mounts="))
    hf = project / '.cache' / 'huggingface'
    # ... and the run's code snapshot, read-only at its own path, last (jobs/runs/code.py)
    assert f"{hf}:{hf}," in mounts and re.search(r"/runs/\.code/[0-9a-f]{16}:[^,]*/runs/\.code/[0-9a-f]{16}:ro$", mounts)


def test_a_user_mount_that_would_hide_the_run_directory_is_refused(project):
    img = project / "img.sqsh"
    img.write_bytes(b"hsqs")
    before = tree(project)
    run_dir = project / "runs" / "tiny_cpu"
    r = slipway("submit", "tiny_cpu", *PYXIS, f"container.image={img}",
                f"container.mounts=[/tmp:{run_dir}/checkpoints]")
    line = one_line_error(r, "container.mounts[0]")
    assert "the run directory" in line and "mount it elsewhere" in line
    assert tree(project) == before


def test_relative_paths_are_absolute_in_the_frozen_config(project):
    (project / "data").mkdir()
    r = slipway("submit", "tiny_cpu", "--dry-run", "data.dataset=./data", "data.cache_dir=cache")
    assert r.returncode == 2, r.stderr  # refused (an empty corpus): its files are rendered all the same
    from jobs import runs
    from jobs.config import load_config

    cfg = load_config("tiny_cpu", ["data.dataset=./data", "data.cache_dir=cache"])
    sealed = runs.seal(cfg, project, dry_run=True)
    assert sealed.cfg.data.dataset == str(project / "data")
    assert sealed.cfg.data.cache_dir == str(project / "cache")
    assert load_config("tiny_cpu").data.cache_dir is None
    assert runs.seal(load_config("tiny_cpu"), project, dry_run=True).cfg.data.cache_dir == \
        str(project / ".cache" / "tokens")


# ------------------------------------------------------------------ the image


def test_no_image_built_is_one_line_with_the_command(project):
    before = tree(project)
    r = slipway("submit", "tiny_cpu", *PYXIS)
    line = one_line_error(r, "container.image")
    assert "make image CONFIG=tiny_cpu" in line
    assert tree(project) == before
    r = slipway("submit", "tiny_cpu", *PYXIS, "--dry-run")
    assert r.returncode == 2 and "\n  - container.image: " in r.stdout


def test_image_is_pinned_to_the_content_addressed_file(project, slurm_stand_ins):
    first = fake_build(project, "1")
    r = slipway("submit", "tiny_cpu", *PYXIS, "--run-name", "pinned", env=slurm_stand_ins)
    assert r.returncode == 0, r.stderr
    run_dir = project / "runs" / "pinned"
    script = (run_dir / "job.sbatch").read_text()
    assert f"--container-image={first}" in srun_line(script)
    assert "slipway.sqsh" not in script  # never the moving link
    manifest = json.loads((run_dir / "manifest.json").read_text())
    image = manifest["submissions"][0]["image"]
    record = json.loads(first.with_suffix(".json").read_text())
    assert image["path"] == str(first) and image["build_hash"] == record["hash"] and image["tag"] == record["tag"]
    assert image["size"] == first.stat().st_size and image["mtime"] and image["source"] == "build"
    assert "differs" not in slipway("status", "pinned", env=slurm_stand_ins).stdout

    # make image again (new sources): the link moves, the submitted run does not
    second = fake_build(project, "2")
    assert second != first and (project / "images" / "slipway.sqsh").resolve() == second
    assert (run_dir / "job.sbatch").read_text() == script
    status = slipway("status", "pinned", env=slurm_stand_ins)
    newer = json.loads(second.with_suffix(".json").read_text())["hash"][:12]
    assert f"uses build {record['hash'][:12]}; a resubmission would run {newer}" in status.stdout, status.stdout
    dockerfile = project / "containers" / "Dockerfile"  # settings that no build has: the run stands as it is
    dockerfile.write_text(dockerfile.read_text() + "# changed after the builds\n")
    status = slipway("status", "pinned", env=slurm_stand_ins)
    assert status.returncode == 0 and "image: a resubmission would be refused: container.image: no image is built " \
        "for this config's image settings" in status.stdout and "the Dockerfile (image.dockerfile) changed" \
        in status.stdout, status.stdout

    # naming the link in the config pins what it points to at submission
    r = slipway("submit", "tiny_cpu", *PYXIS, "--run-name", "linked", "container.image=./images/slipway.sqsh",
                env=slurm_stand_ins)
    assert r.returncode == 0, r.stderr
    assert f"--container-image={second}" in srun_line((project / "runs" / "linked" / "job.sbatch").read_text())


def test_a_foreign_squashfs_is_identified_by_its_bytes(project, slurm_stand_ins):
    img = project / "theirs.sqsh"
    img.write_bytes(b"hsqs-theirs")
    r = slipway("submit", "tiny_cpu", "container.runtime=edf", "container.image=./theirs.sqsh", "--run-name", "f",
                env=slurm_stand_ins)
    assert r.returncode == 0, r.stderr
    image = json.loads((project / "runs" / "f" / "manifest.json").read_text())["image"]
    import hashlib

    assert image["sha256"] == hashlib.sha256(b"hsqs-theirs").hexdigest() and image["path"] == str(img)
    from edf import parse_edf

    assert parse_edf(project / "runs" / "f" / "env.toml").image == str(img)


def test_a_base_environment_that_supplies_the_image_needs_no_container_image(project, tmp_path, slurm_stand_ins):
    edf_dir = tmp_path / "edfs"
    edf_dir.mkdir()
    (edf_dir / "site.toml").write_text('image = "nvcr.io/nvidia/pytorch:25.12-py3"\n')
    env = {**slurm_stand_ins, "EDF_PATH": str(edf_dir)}
    r = slipway("submit", "tiny_cpu", "container.runtime=edf", "container.base_environment=[site]",
                "--run-name", "b", env=env)
    assert r.returncode == 0, r.stderr
    toml = (project / "runs" / "b" / "env.toml").read_text()
    assert 'base_environment = [\n    "site",\n]' in toml and 'image = "nvcr.io/nvidia/pytorch:25.12-py3"' in toml


# ------------------------------------------------------------------ shell


def test_shell_never_writes_into_a_submitted_run(project, slurm_stand_ins):
    img = project / "img.sqsh"
    img.write_bytes(b"hsqs")
    r = slipway("submit", "tiny_cpu", "container.runtime=edf", f"container.image={img}", "--run-name", "s1",
                env=slurm_stand_ins)
    assert r.returncode == 0, r.stderr
    run_dir = project / "runs" / "s1"
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    other = project / "other.sqsh"
    other.write_bytes(b"hsqs2")
    r = slipway("shell", "tiny_cpu", "container.runtime=edf", f"container.image={other}", "--run-name", "s1",
                "--dry-run")
    assert r.returncode == 0, r.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    # The EDF, then the command; the EDF goes to a private temporary file only while a shell runs.
    *edf_lines, command = r.stdout.splitlines()
    words = shlex.split(command)
    edf_file = Path(next(w for w in words if w.startswith("--environment=")).split("=", 1)[1])
    from edf import Mount, parse_edf

    shell_env = parse_edf("\n".join(edf_lines[1:]))
    assert edf_file.parent.parent == project / "runs" / ".shell" and not edf_file.exists()
    assert shell_env.image == str(other)
    assert Mount(str(run_dir), str(run_dir)) in shell_env.mounts
    assert words[:2] == ["srun", "--nodes=1"] and words[-1] == "bash"


def test_shell_under_pyxis_expands_variables_and_passes_env_values(project):
    img = project / "img.sqsh"
    img.write_bytes(b"hsqs")
    scratch = project / "scratch"
    scratch.mkdir()
    r = slipway("shell", "tiny_cpu", *PYXIS, f"container.image={img}", "container.mounts=[${SCRATCH}:/scratch]",
                "container.env.GREETING=hello ${USER_NAME}", "--dry-run",
                env={"SCRATCH": str(scratch), "USER_NAME": "ada"})
    assert r.returncode == 0, r.stderr
    words = shlex.split(r.stdout)
    assert "GREETING=hello ada" in words[:4]
    mounts = next(w for w in words if w.startswith("--container-mounts="))
    # The run directory and the caches do not exist yet: the shell leaves them out (tests/test_pinned.py).
    code = next(w for w in words if w.startswith("SLIPWAY_CODE=")).split("=", 1)[1]
    assert mounts == f"--container-mounts={scratch}:/scratch,{code}:{code}:ro" and "${" not in r.stdout
    assert "--container-env=GREETING,SLIPWAY_CODE,PYTHONPATH,PYTHONSAFEPATH" in words
    r = slipway("shell", "tiny_cpu", *PYXIS, f"container.image={img}", "container.mounts=[${NOPE_UNSET}:/x]",
                "--dry-run")
    one_line_error(r, "container.mounts[0]")


# ------------------------------------------------------------------ the batch script


def run_script(script: str, run_dir: Path, bin_dir: Path, env: dict) -> subprocess.CompletedProcess:
    """Run a batch script with stand-in Slurm commands. Its output goes to a file: the script's
    heartbeat helper outlives it by up to a minute and would hold a pipe open."""
    with (run_dir / "script.out").open("w") as out:
        r = subprocess.run(["bash", "-c", script], stdout=out, stderr=subprocess.STDOUT, text=True, timeout=60,
                           env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(run_dir), "SLURM_NNODES": "1",
                                **env})
    r.stderr = (run_dir / "script.out").read_text()
    return r


def stand_in(bin_dir: Path, name: str, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text("#!/bin/bash\n" + body)
    (bin_dir / name).chmod(0o755)


def rendered(project: Path, *overrides: str) -> tuple[str, Path]:
    from jobs import runs
    from jobs.config import load_config

    cfg = load_config("tiny_cpu", list(overrides))
    sealed = runs.seal(cfg, project, dry_run=True)
    sealed.paths.path.mkdir(parents=True, exist_ok=True)
    for path, text in sealed.files.items():  # what the script sources and checks, as a submission writes it
        if path.parent == sealed.paths.lib:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
    if sealed.code is not None:
        sealed.code.write()
    return sealed.files[sealed.paths.job_script], sealed.paths.path


@pytest.mark.slow
def test_master_addr_survives_a_1024_node_allocation(project, tmp_path):
    """`scontrol show hostnames | head -n 1` under pipefail died with SIGPIPE on large allocations.
    (Without a code snapshot: each of the 1024 stand-in nodes would hash it, which is not the point.)"""
    script, run_dir = rendered(project, "slurm.gpus_per_node=0", "code.snapshot=false")
    bin_dir = tmp_path / "bin"
    hosts = "".join(f"nid{i:06d}\n" for i in range(1024))
    stand_in(bin_dir, "scontrol", f"printf '%s' {shlex.quote(hosts)}\n")
    # Every line runs at that size: the preflight reads the 1024 names back, one report each.
    stand_in(bin_dir, "srun", SRUN_PASSING_PREFLIGHT + 'echo "MASTER_ADDR=$MASTER_ADDR" > "$RUN_DIR/seen"\n')
    for _ in range(10):
        r = run_script(script, run_dir, bin_dir, {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "nid[000000-001023]",
                                                  "RUN_DIR": str(run_dir)})
        assert r.returncode == 0, r.stderr
        assert (run_dir / "seen").read_text() == "MASTER_ADDR=nid000000\n"


@pytest.mark.parametrize("requeues, requeued", [(0, True), (3, True), (4, False)])
def test_requeues_stop_at_max_requeues(project, tmp_path, requeues, requeued):
    """The job counts its own time-limit requeues in events.log (its id survives them; a failure
    retry also raises SLURM_RESTART_COUNT, and must not use them up)."""
    script, run_dir = rendered(project, "slurm.max_requeues=4")
    (run_dir / "events.log").write_text(
        "".join(f"2026-01-01T00:00:0{i}+00:00 job 9 time-limit requeue {i + 1}/4: saved, requeueing\n"
                for i in range(requeues))
        + "2026-01-01T00:00:09+00:00 job 9 retry 1/2 (hang): requeueing (no node to blame)\n"
        + "2026-01-01T00:00:09+00:00 job 8 time-limit requeue 1/4: another job's\n")
    bin_dir = tmp_path / "bin"
    stand_in(bin_dir, "scontrol", 'if [ "$1" = requeue ]; then echo "$2" > "$RUN_DIR/requeued"; else echo n1; fi\n')
    stand_in(bin_dir, "srun", SRUN_PASSING_PREFLIGHT + "exit 75\n")  # the trainer saved after a stop request
    r = run_script(script, run_dir, bin_dir, {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n1",
                                              "SLURM_RESTART_COUNT": str(requeues + 1), "RUN_DIR": str(run_dir)})
    events = (run_dir / "events.log").read_text()
    if requeued:
        assert r.returncode == 0 and (run_dir / "requeued").read_text() == "9\n", r.stderr
        assert f"time-limit requeue {requeues + 1}/4: saved after the stop request" in events
    else:
        assert r.returncode == 75 and not (run_dir / "requeued").exists(), r.stderr
        assert "not requeueing after the time-limit warning: slurm.max_requeues (4) reached" in events


def test_pre_launch_syntax_is_checked_at_submission(project):
    before = tree(project)
    r = slipway("submit", "tiny_cpu", "launch.pre_launch=[if true; then echo x]")
    line = one_line_error(r, "launch.pre_launch")
    assert "does not parse" in line
    r = slipway("submit", "tiny_cpu", "--dry-run", "launch.pre_launch=[if true; then echo x]")
    one_line_error(r, "launch.pre_launch")
    assert tree(project) == before


def test_pyxis_drops_are_said_at_submission(project):
    img = project / "img.sqsh"
    img.write_bytes(b"hsqs")
    r = slipway("submit", "tiny_cpu", "--dry-run", *PYXIS, f"container.image={img}",
                "container.annotations.com.hooks.aws_ofi_nccl.enabled=true")
    assert r.returncode == 0, r.stderr
    assert "note: pyxis: container.annotations.com.hooks.aws_ofi_nccl.enabled" in r.stdout
    assert "has no pyxis equivalent" in r.stdout


# ------------------------------------------------------------------ edf --check, doctor


def test_edf_check_reports_every_problem(project):
    path = project / "hand written.toml"
    path.write_text('image = "images/x.sqsh"\nworkdir = "w"\nmounts = ["/a:/b:nope", "/ok"]\n'
                    '[env]\nA = "1"\nB = "${A}"\n')
    r = slipway("edf", "--check", str(path))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 5 and lines[-1] == f"{path}: 4 problem(s)", r.stderr
    for field in ("image", "workdir", "mounts[0]", "env.B"):
        assert any(line.startswith(f"slipway: error: {path}:{field}:") for line in lines), (field, lines)
    path.write_text('image = "nvcr.io/nvidia/pytorch:25.12-py3"\nmounts = ["${SLIPWAY_SHARED:-/}"]\n[env]\n'
                    'X = "${HOME}"\n')  # the mount source must exist here (edf --check looks)
    assert slipway("edf", "--check", str(path)).stdout == f"{path}: ok\n"
    r = slipway("edf", "--to-pyxis", str(path))
    assert r.returncode == 0, r.stderr
    assert "export X=\"${HOME}\"" in r.stdout
    assert "--container-image=nvcr.io#nvidia/pytorch:25.12-py3" in r.stdout
    assert '--container-mounts="${SLIPWAY_SHARED:-/}":"${SLIPWAY_SHARED:-/}"' in r.stdout


def test_edf_command_prints_and_installs(project, tmp_path):
    img = project / "img.sqsh"
    img.write_bytes(b"hsqs")
    edf_dir = tmp_path / "edf home"
    env = {"EDF_PATH": f"{edf_dir}:/elsewhere"}
    args = ["edf", "tiny_cpu", "container.runtime=edf", f"container.image={img}", "--run-name", "e1"]
    r = slipway(*args, env=env)
    from edf import parse_edf

    assert r.returncode == 0 and parse_edf(r.stdout).image == str(img), r.stderr
    assert not (project / "runs").exists()  # printing writes nothing
    assert slipway(*args, "--install", env=env).returncode == 0
    assert (edf_dir / "e1.toml").read_text() == r.stdout
    r = slipway(*args, "container.workdir=/w", "--install", env=env)
    assert r.returncode == 2 and "--force" in r.stderr
    assert slipway(*args, "container.workdir=/w", "--install", "--force", env=env).returncode == 0
    assert 'workdir = "/w"' in (edf_dir / "e1.toml").read_text()


def test_doctor_without_a_controller_lists_every_failure(project, tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=nowhere-host(127.0.0.1)\nSlurmctldPort=9\n"
                    "NodeName=n1 CPUs=1\nPartitionName=p Nodes=n1 Default=YES\n")
    if shutil.which("scontrol") is None:
        pytest.skip("needs Slurm's client commands (Debian slurm-wlm)")
    r = slipway("doctor", "tiny_cpu", *PYXIS, "container.image=./images/missing.sqsh",
                "container.mounts=[/nonexistent-src:/d]", env={"SLURM_CONF": str(conf)}, timeout=180)
    assert r.returncode == 1
    failures = [line for line in r.stdout.splitlines() if line.startswith("fail")]
    assert any(line.startswith("fail slurm controller") for line in failures), r.stdout
    assert any("container.mounts[0]" in line for line in failures), r.stdout
    assert any("container.image: squashfs ./images/missing.sqsh" in line for line in failures), r.stdout
    assert "parallel layout: note:" not in r.stdout  # tiny_cpu's custom model has no published layout


def test_doctor_without_any_slurm_configuration_gives_scontrols_reason_once(project):
    """A login node's shell without SLURM_CONF and no slurm.conf: scontrol tries DNS and gives
    up with one fatal line, which doctor quotes instead of every source it tried."""
    if shutil.which("scontrol") is None:
        pytest.skip("needs Slurm's client commands (Debian slurm-wlm)")
    if Path("/etc/slurm/slurm.conf").exists():
        pytest.skip("this machine has a default slurm.conf")
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    r = subprocess.run([PY, "-m", "jobs", "doctor", "tiny_cpu"], capture_output=True, text=True, timeout=180, env=env)
    said = next(line for line in r.stdout.splitlines() if line.startswith("fail slurm controller"))
    assert said.count("scontrol:") == 1 and "Could not establish a configuration source" in said, said
    # The fix named depends on whether a local test cluster is up meanwhile (another test's).
    assert ("no Slurm controller answers" in said or "SLURM_CONF is not set" in said) and r.returncode == 1, said


def test_doctor_names_the_presets_published_layout(project, tmp_path):
    """tiny_wikitext (the CSCS tutorial's tp=4 x dp=2 for a 109M model) strays from the tiny
    preset's default: doctor says which layout to use instead, as a note, not a failure."""
    if shutil.which("scontrol") is None:
        pytest.skip("needs Slurm's client commands (Debian slurm-wlm)")
    shutil.copy(ROOT / "configs" / "tiny_wikitext.yaml", project / "configs")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=nowhere-host(127.0.0.1)\nSlurmctldPort=9\n"
                    "NodeName=n1 CPUs=1\nPartitionName=p Nodes=n1 Default=YES\n")
    r = slipway("doctor", "tiny_wikitext", env={"SLURM_CONF": str(conf), "SCRATCH": str(tmp_path)}, timeout=180)
    notes = [line for line in r.stdout.splitlines() if line.startswith("ok   parallel layout: note: ")]
    assert len(notes) == 1, r.stdout
    assert "tp(4) splits the tiny preset (109M parameters)" in notes[0]
    assert "parallel.dp=8 parallel.tp=1 parallel.pp=1 (FSDP) with train.micro_batch_size=16" in notes[0]
    r = slipway("doctor", "tiny_wikitext", "--tp", "1", "--dp", "8", "train.micro_batch_size=16",
                env={"SLURM_CONF": str(conf), "SCRATCH": str(tmp_path)}, timeout=180)
    assert "parallel layout: note:" not in r.stdout and "ok   parallel layout: dp(8) x tp(1)" in r.stdout, r.stdout


# ------------------------------------------------------------------ local runs


def local_command(code: str) -> list[str]:
    return [f"launch.command=[{PY}, -c, {json.dumps(code)}]", "launch.procs_per_node=1"]


@pytest.mark.slow
def test_local_runs_in_status_and_logs(project):
    r = slipway("local", "tiny_cpu", "--run-name", "ok", *local_command("print('hello local')"))
    assert r.returncode == 0, r.stderr
    status = slipway("status", "ok")
    assert "COMPLETED" in status.stdout and "local" in status.stdout
    logs = slipway("logs", "ok")
    assert logs.returncode == 0 and "hello local" in logs.stdout
    r = slipway("local", "tiny_cpu", "--run-name", "bad", *local_command("import sys; sys.exit(3)"))
    assert r.returncode == 3
    status = slipway("status", "bad")
    assert "FAILED" in status.stdout and " 3 " in status.stdout
    overview = slipway("status")
    assert "ok" in overview.stdout and "bad" in overview.stdout
    mode = stat.S_IMODE((project / "runs" / "ok").stat().st_mode)
    assert mode & 0o050 == 0o050, oct(mode)  # group can read and enter (umask 022 here)


@pytest.mark.slow
def test_ctrl_c_on_local_says_interrupted_and_how_to_resume(project):
    proc = subprocess.Popen([PY, "-m", "jobs", "local", "tiny_cpu", "--run-name", "cc",
                             *local_command("import time; print('up', flush=True); time.sleep(60)")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=default_signals)
    deadline = time.time() + 60
    log = project / "runs" / "cc" / "logs"
    while time.time() < deadline and not any("up" in p.read_text() for p in log.glob("local-*.out")):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "interrupted (Ctrl-C) before its first checkpoint: `" in out and "starts from step 0" in out, out
    assert "failed" not in out and "Traceback" not in out  # the command's KeyboardInterrupt: in the log only
    assert "INTERRUPTED" in slipway("status", "cc").stdout


# ------------------------------------------------------------------ fixtures


@pytest.fixture
def slurm_stand_ins(tmp_path) -> dict:
    """sbatch/scontrol/squeue stand-ins that accept a job and report it ended: for tests of what submit writes."""
    bin_dir = tmp_path / "fake-slurm"
    stand_in(bin_dir, "sbatch", 'echo "$((RANDOM + 100))"\n')
    stand_in(bin_dir, "scontrol", '[ "$1" = ping ] && echo "Slurmctld(primary) at n1 is UP"; exit 0\n')
    stand_in(bin_dir, "squeue", squeue_answering("COMPLETED"))
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
