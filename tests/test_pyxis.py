"""The pyxis path for real: `make image` with the real enroot, then `slipway submit` with
runtime pyxis on a 2-node local Slurm whose nodes load the real pyxis plugin, training in
the image's containers on both nodes with the run directory mounted by slipway.

enroot and pyxis are not packaged anywhere CI can install them from; they build from their
public sources (NVIDIA/enroot, NVIDIA/pyxis; see the lab notes). This test runs where
`enroot` is on PATH and SLIPWAY_PYXIS_PLUGIN names the built spank_pyxis.so, and skips with
that reason elsewhere.
"""

from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs.devcluster import ClusterSpec, LocalSlurmCluster, default_state_dir, read_registry, unavailable_reason

PY = sys.executable
ROOT = Path(__file__).resolve().parent.parent
PLUGIN = os.environ.get("SLIPWAY_PYXIS_PLUGIN", "")


def _why_not() -> str | None:
    if not PLUGIN or not Path(PLUGIN).is_file():
        return "set SLIPWAY_PYXIS_PLUGIN to a built spank_pyxis.so (NVIDIA/pyxis) to run the real pyxis path"
    if shutil.which("enroot") is None:
        return "enroot (NVIDIA/enroot) is not installed"
    return unavailable_reason()


pytestmark = [pytest.mark.slurm, pytest.mark.podman, pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))]

TINY = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=2", "data.seq_len=64", "model.max_position_embeddings=64", "train.micro_batch_size=4",
        "train.steps=6", "train.eval_interval=0", "train.warmup_steps=2", "logging.interval=1",
        "checkpoint.interval=3"]


def run(*argv: str, env: dict, cwd: Path, timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **env})


@pytest.fixture
def pyxis_cluster(tmp_path: Path):
    """A 2-node cluster of its own (names, subnet and ports apart from the session's) whose
    nodes load pyxis, each with its own enroot data/runtime dirs and pyxis runtime path."""
    runtime = tmp_path / "pyxis-runtime"
    plugstack = tmp_path / "plugstack.conf"
    plugstack.write_text(f"required {PLUGIN} runtime_path={runtime}\n")
    spec = ClusterSpec(state_dir=default_state_dir("pyxis"), nodes=2, name="slpwx", node_prefix="slpwx-node",
                       ctl_host="slpwx-ctl", subnet="10.213.3", ctld_port=6947, slurmd_port=6948,
                       plugstack=plugstack,
                       node_private=(str(runtime), "/run/enroot", "/root/.local/share/enroot", "/root/.cache/enroot"))
    cluster = LocalSlurmCluster(spec).up()
    try:
        yield cluster
    finally:
        cluster.down()


def wait_gone(job: str, env: dict, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while subprocess.run(["squeue", "-h", "-j", job], env={**os.environ, **env}, capture_output=True,
                         text=True).stdout.strip():
        assert time.monotonic() < deadline, f"job {job} still queued or running"
        time.sleep(0.5)


def test_pyxis_job_trains_in_the_image_on_two_nodes(pyxis_cluster: LocalSlurmCluster, tmp_path: Path):
    from test_image import TEST_BASE, ensure_test_base, ensure_wheelhouse

    ensure_test_base()
    wheels = ensure_wheelhouse()
    images = tmp_path / "images"
    # The image settings every command of the run gives alike: a submission runs the build of its own.
    image = [f"image.base_image={TEST_BASE}", "image.flash_attn=false", f"image.wheelhouse={wheels}",
             "image.isolation=chroot", f"image.output_dir={images}", "image.squash_options=-comp lz4"]
    build = run(PY, "-m", "jobs", "image", "build", "tiny_cpu", *image, env={}, cwd=ROOT)
    assert build.returncode == 0, (build.stdout[-3000:], build.stderr[-3000:])
    squashfs = json.loads((images / "slipway.json").read_text())["squashfs"]
    assert Path(squashfs).is_file()

    project = tmp_path / "project"
    (project / "configs").mkdir(parents=True)
    shutil.copy(ROOT / "configs" / "tiny_cpu.yaml", project / "configs")
    env = {**pyxis_cluster.env(), "SLIPWAY_PROJECT": str(project)}
    # The host's python3 has no torch: training can only have run in the image.
    assert run("/usr/bin/python3", "-c", "import torch", env={}, cwd=project).returncode != 0
    r = run(PY, "-m", "jobs", "submit", "tiny_cpu", "--run-name", "pyx", "--nodes", "2", "--dp", "4", *TINY,
            "container.runtime=pyxis", *image, "--show-logs", env=env, cwd=project)
    run_dir = project / "runs" / "pyx"
    assert r.returncode == 0, (r.stdout[-4000:], r.stderr[-4000:])
    script = (run_dir / "job.sbatch").read_text()
    assert f"--container-image={squashfs}" in script
    assert f"{run_dir}:{run_dir}" in script  # slipway mounted the run directory
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if json.loads(line).get("kind") == "train"]
    assert steps[-1] == 6
    assert (run_dir / "checkpoints" / "step-000006" / "COMPLETE").is_file()
    # The preflight's all-reduce ran inside the containers, as the training step's first collective.
    assert re.search(r" preflight ok on \S+: all-reduce of 4 MiB over 4 ranks on 2 node\(s\) \(gloo\)",
                     (run_dir / "events.log").read_text()), (run_dir / "events.log").read_text()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["image"]["path"] == squashfs and manifest["image"]["source"] == "build"
    # The run's code snapshot, mounted read-only at its own path and first on PYTHONPATH: the
    # trainer refuses any other code (common.rundir.check_code), so these steps ran it.
    code = manifest["code"]["dir"]
    assert f"{code}:{code}:ro" in script and "--container-env=" in script and (Path(code) / "trainer").is_dir()

    # One container per node for the job's two steps, kept for later jobs of this build
    # (container.keep_builds): each node's check unpacked it whole, under its lock, before any step
    # (ensure_container), so pyxis created none and both steps (the preflight's node step, then
    # training, whose first collective is the preflight's all-reduce) started in it.
    build = "i" + manifest["image"]["build_hash"][:16]
    assert f"CONTAINER_BUILD={build}" in script and '--container-name="${CONTAINER_NAME}":no_exec' in script
    # Named by this project too (containers/project.py), so that only its jobs' sweeps touch them.
    from containers.context import build_root
    from containers.project import Project

    named = f"pyxis_slipway-{Project.of(build_root(project, 'containers/Dockerfile')).token}-"
    kept = f"{named}{build}"

    def slurmd_log() -> str:
        return "".join(p.read_text(errors="replace") for p in pyxis_cluster.spec.log_dir.glob("slurmd-*.log"))

    def on_node(node: str, *argv: str) -> str:
        pid = next(p["pid"] for p in read_registry(pyxis_cluster.spec.name)["processes"]
                   if p["role"] == f"slurmd {node}")
        return subprocess.run(["nsenter", "-t", str(pid), "-m", *argv], capture_output=True, text=True,
                              check=True).stdout

    def containers(node: str) -> list[str]:
        return [c for c in on_node(node, "enroot", "list").split() if c.startswith("pyxis_")]

    data = "/root/.local/share/enroot"  # enroot's default data path (node-private here)
    files_in_image = len([line for line in subprocess.run(["unsquashfs", "-l", squashfs], capture_output=True,
                                                          text=True, check=True).stdout.splitlines()
                          if line.startswith("squashfs-root/")])

    def complete(node: str) -> bool:
        """Every file of the image unpacked (jobs add their own: caches), and the mark of the build."""
        count = len(on_node(node, "find", f"{data}/{kept}", "-mindepth", "1").splitlines())
        mark = on_node(node, "cat", f"{data}/.slipway/{kept}.ready").strip()
        print(f"{node}: {count} entries in the kept container, {files_in_image} in the image; mark {mark[:12]}")
        return count >= files_in_image and mark == manifest["image"]["build_hash"]

    assert slurmd_log().count(f"pyxis: creating container filesystem: {kept}") == 0, slurmd_log()[-3000:]
    # Two steps on each of the two nodes (the preflight's node step, training) and the curves'
    # step on one (trainer/plot.py, the batch script's last), all in the kept container.
    steps = 2 * 2 + 1
    assert slurmd_log().count("pyxis: reusing existing container filesystem") == steps, slurmd_log()[-3000:]
    nodes = pyxis_cluster.node_names
    assert all(containers(node) == [kept] and complete(node) for node in nodes), {n: containers(n) for n in nodes}

    # A second run of the same build unpacks nothing: every step starts in the kept container.
    second = run(PY, "-m", "jobs", "submit", "tiny_cpu", "--run-name", "pyx2", "--nodes", "2", "--dp", "4", *TINY,
                 "container.runtime=pyxis", *image, "--show-logs", env=env, cwd=project)
    assert second.returncode == 0, (second.stdout[-3000:], second.stderr[-3000:])
    assert slurmd_log().count("pyxis: creating container filesystem") == 0, slurmd_log()[-3000:]
    assert slurmd_log().count("pyxis: reusing existing container filesystem") == 2 * steps, slurmd_log()[-3000:]

    # Two first jobs of the build starting at the same moment on the same nodes: both train, the
    # container is unpacked once per node, whole.
    removed = run(PY, "-m", "jobs", "image", "containers", "tiny_cpu", "--nodes", ",".join(nodes), "--remove",
                  env=env, cwd=project)
    assert removed.returncode == 0 and not [n for n in nodes if containers(n)], (removed.stdout, removed.stderr)
    jobs = []
    for name in ("pyxa", "pyxb"):
        r = run(PY, "-m", "jobs", "submit", "tiny_cpu", "--run-name", name, "--nodes", "2", "--dp", "4", *TINY,
                "container.runtime=pyxis", *image, "--parsable", "slurm.extra=[--hold]", env=env, cwd=project)
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
        jobs.append(r.stdout.strip().split(";")[0])
    run("scontrol", "release", ",".join(jobs), env=env, cwd=project).check_returncode()  # both at once
    for name, job in zip(("pyxa", "pyxb"), jobs):
        wait_gone(job, env)
        events = (project / "runs" / name / "events.log").read_text()
        assert f"job {job} end exit 0" in events and "retry" not in events and "preflight failed" not in events, events
        assert (project / "runs" / name / "checkpoints" / "step-000006" / "COMPLETE").is_file()
    assert all(containers(node) == [kept] and complete(node) for node in nodes), {n: containers(n) for n in nodes}
    assert slurmd_log().count("pyxis: creating container filesystem") == 0, slurmd_log()[-3000:]

    # A sweep's points (jobs/runs/sweep.py) are tasks of one array, jobs of one build alike: two
    # tasks, the first of the build, starting at once on the same nodes train in the container
    # each node unpacked once, whole.
    removed = run(PY, "-m", "jobs", "image", "containers", "tiny_cpu", "--nodes", ",".join(nodes), "--remove",
                  env=env, cwd=project)
    assert removed.returncode == 0 and not [n for n in nodes if containers(n)], (removed.stdout, removed.stderr)
    r = run(PY, "-m", "jobs", "sweep", "tiny_cpu", "--name", "pyxs", "--nodes", "2", "--dp", "4", *TINY,
            "container.runtime=pyxis", *image, "train.lr=[3e-3, 1e-3]", "slurm.extra=[--hold]", env=env, cwd=project)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    array = json.loads((project / "runs" / ".sweeps" / "pyxs" / "sweep.json").read_text())["arrays"][0]["job_id"]
    run("scontrol", "release", array, env=env, cwd=project).check_returncode()  # both tasks at once
    wait_gone(array, env)
    for task, name in enumerate(("pyxs-lr3e-3", "pyxs-lr1e-3")):
        events = (project / "runs" / name / "events.log").read_text()
        assert f"job {array}_{task} end exit 0" in events, events
        assert "retry" not in events and "preflight failed" not in events, events
        assert (project / "runs" / name / "checkpoints" / "step-000006" / "COMPLETE").is_file()
    assert all(containers(node) == [kept] and complete(node) for node in nodes), {n: containers(n) for n in nodes}
    assert slurmd_log().count("pyxis: creating container filesystem") == 0, slurmd_log()[-3000:]

    # The squashfs removed between submission and start: one line, exit 2, no retry, no node blamed.
    r = run(PY, "-m", "jobs", "submit", "tiny_cpu", "--run-name", "pyxgone", "--nodes", "2", "--dp", "4", *TINY,
            "container.runtime=pyxis", *image, "--parsable", "slurm.extra=[--hold]", env=env, cwd=project)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    job = r.stdout.strip().split(";")[0]
    aside = Path(squashfs).with_name("aside.sqsh")
    os.rename(squashfs, aside)
    try:
        asked = time.monotonic()
        run("scontrol", "release", job, env=env, cwd=project).check_returncode()
        wait_gone(job, env)
        print(f"squashfs removed -> job ended: {time.monotonic() - asked:.1f} s")
    finally:
        os.rename(aside, squashfs)
    events = (project / "runs" / "pyxgone" / "events.log").read_text()
    assert f"verification failed: the image {squashfs} is not there (removed or moved after submission" in events, events
    assert f"job {job} end exit 2" in events and "retry" not in events and "preflight" not in events, events

    # `slipway cancel` of a job with its own container (keep_builds 0) during training: told as
    # cancelled, and its container removed from every node while the allocation still exists.
    cancel = run(PY, "-m", "jobs", "submit", "tiny_cpu", "--run-name", "pyxc", "--nodes", "2", "--dp", "4", *TINY,
                 "train.steps=100000", "checkpoint.interval=100000", "container.runtime=pyxis",
                 "container.keep_builds=0", *image, "--parsable", env=env, cwd=project)
    assert cancel.returncode == 0, (cancel.stdout[-3000:], cancel.stderr[-3000:])
    job = cancel.stdout.strip().split(";")[0]
    metrics = project / "runs" / "pyxc" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and '"train"' in metrics.read_text()):
        assert time.monotonic() < deadline, (project / "runs" / "pyxc" / "events.log").read_text()
        time.sleep(1)
    assert any(c == f"{named}{job}" for c in containers(nodes[0]))
    asked = time.monotonic()
    stopped = run(PY, "-m", "jobs", "cancel", "pyxc", env=env, cwd=project)
    assert stopped.returncode == 0, (stopped.stdout, stopped.stderr)
    wait_gone(job, env)
    print(f"slipway cancel -> job gone: {time.monotonic() - asked:.1f} s")
    events = (project / "runs" / "pyxc" / "events.log").read_text()
    assert "cancelled by slipway cancel" in events and "end exit 140" in events, events
    assert "CANCELLED" in run(PY, "-m", "jobs", "status", "pyxc", env=env, cwd=project).stdout.upper()
    # Its own container goes with it, within a bound a loaded disk may pass: then the next sweep
    # (here the command a user types) removes it, as its job is over. Either way none is left.
    left = [n for n in nodes if f"{named}{job}" in containers(n)]
    print(f"its container removed by the job's end on {len(nodes) - len(left)} of {len(nodes)} node(s)")
    if left:
        listed = run(PY, "-m", "jobs", "image", "containers", "tiny_cpu", "--nodes", ",".join(left), env=env,
                     cwd=project)
        assert all(f"{n}: would remove {named}{job}" in listed.stdout for n in left), listed.stdout

    # The kept containers, listed and removed by the command a user types.
    listed = run(PY, "-m", "jobs", "image", "containers", "tiny_cpu", "--nodes", ",".join(nodes), env=env, cwd=project)
    assert listed.returncode == 0, (listed.stdout, listed.stderr)
    for node in nodes:
        assert f"{node}: would remove {kept}" in listed.stdout, listed.stdout
    assert all(kept in containers(node) for node in nodes)
    removed = run(PY, "-m", "jobs", "image", "containers", "tiny_cpu", "--nodes", ",".join(nodes), "--remove",
                  env=env, cwd=project)
    assert removed.returncode == 0 and f"{nodes[0]}: removed {kept}" in removed.stdout, (removed.stdout, removed.stderr)
    assert not [n for n in nodes if containers(n)], {n: containers(n) for n in nodes}
