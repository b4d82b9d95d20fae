"""The pyxis paths for real (the `pyxis` tier: `pytest -m pyxis`): a 2-node local Slurm whose nodes
load the real pyxis plugin, with the real enroot, both built from their release sources by `make
pyxis` into .pyxis/ (found there: no variable to set). One image build (real podman, real enroot
import) and one base image serve the whole tier; every test runs the commands a user types:

- the README's pyxis path: both nodes train in the image's containers, the run directory mounted,
  and the run's end draws its curves in the image;
- the seal on the node: a code snapshot changed, or the squashfs moved, after submission;
- a node whose container cannot start there: told as it was (not "no report within 300 s");
- a killed rank and a frozen one: named (rank, node, signal; how many ranks wrote no dump), and
  the run resumes exactly, loss for loss;
- Ctrl-C of `slipway run`, and the printed command that resumes exactly;
- warm ranks: a second `slipway run` in the allocation runs changed code from the warm processes;
- first jobs of a build starting at once (two runs and a sweep's two array tasks): all train, one
  unpack per node, the kept container whole;
- `slipway image containers`: listed, removed from every node, and never "none" for a node that
  cannot tell.

The tier's cluster (slpwx-*) has its own names, addresses, ports, state directory and job ids, apart
from the session cluster's (tests/slurm_fixtures.py) that other tests use meanwhile; its runs are
named pyx* and found by their own paths.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import default_signals
from jobs.devcluster import ClusterSpec, LocalSlurmCluster, default_state_dir, read_registry, unavailable_reason
from slurm_fixtures import kept_up
from test_dev_loop import checkout, mark_parent
from test_e2e import FINISHED, complete_checkpoints, steps_logged, wait_for

PY = sys.executable
ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / ".pyxis"  # `make pyxis`
ENROOT_BIN = RUNTIME / "enroot" / "bin"
PLUGSTACK = RUNTIME / "plugstack.conf"
# What each node gets its own copy of: pyxis's runtime path (plugstack.conf) and enroot's
# directories (pinned in the runtime's enroot.conf).
NODE_PRIVATE = ("/run/pyxis", "/run/enroot", "/root/.local/share/enroot", "/root/.cache/enroot")
DATA = "/root/.local/share/enroot"


def _why_not() -> str | None:
    if not (ENROOT_BIN / "enroot").is_file() or not PLUGSTACK.is_file():
        return ("the pyxis runtime is not built: `make pyxis` builds enroot and pyxis from their release sources "
                "into .pyxis/ (docs/clusters.md)")
    if shutil.which("podman") is None:
        return "podman is not installed (the tier builds its image with it)"
    return unavailable_reason()


pytestmark = [pytest.mark.pyxis, pytest.mark.slurm, pytest.mark.podman,
              pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))]

TINY = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=2", "data.seq_len=64", "model.max_position_embeddings=64", "train.micro_batch_size=4",
        "train.steps=6", "train.eval_interval=0", "train.warmup_steps=2", "logging.interval=1",
        "checkpoint.interval=3", "--nodes", "2", "--dp", "4"]
# Long enough for a rank to be killed, frozen or interrupted mid-run: the README path trains it
# once, uninterrupted, as the reference every resumed run of it must match loss for loss.
LONG = [*TINY, "train.steps=40", "train.micro_batch_size=8", "checkpoint.interval=10",
        "train.hang_timeout=15", "train.hang_timeout_first_step=120"]


@dataclass
class Lab:
    cluster: LocalSlurmCluster
    project: Path
    env: dict
    image: list[str]  # the image settings every command gives alike
    squashfs: str
    build_hash: str
    kept: str  # the build's kept container, named by this project and the build

    @property
    def nodes(self) -> list[str]:
        return self.cluster.spec.node_names

    def slipway(self, *args: str, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
        try:
            return subprocess.run([PY, "-m", "jobs", *args], capture_output=True, text=True, timeout=timeout,
                                  cwd=self.project, env=env or self.env)
        except subprocess.TimeoutExpired:  # say what the cluster was doing meanwhile
            said = {argv[0]: subprocess.run(argv, env=self.env, capture_output=True, text=True).stdout
                    for argv in (["squeue", "-o", "%i %T %R"], ["sinfo", "-N", "-o", "%N %T %E"])}
            dead = [p["role"] for p in self.cluster.status().get("processes", []) if not p["alive"]]
            pytest.fail(f"slipway {' '.join(args[:4])} ... ran past {timeout} s; {said}; daemons exited: {dead}")

    def submit(self, name: str, *args: str) -> str:
        """`slipway submit` of run `name` in the image, not followed: its job id."""
        r = self.slipway("submit", "tiny_cpu", "--run-name", name, *args, "container.runtime=pyxis", *self.image,
                         "--parsable")
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
        return r.stdout.strip().split(";")[0]

    def run_dir(self, name: str) -> Path:
        return self.project / "runs" / name

    def events(self, name: str) -> str:
        return (self.run_dir(name) / "events.log").read_text()

    def scontrol(self, *args: str) -> None:
        subprocess.run(["scontrol", *args], env=self.env, check=True, capture_output=True)

    def wait_gone(self, job: str, timeout: float = 900) -> None:
        wait_for(lambda: self.state(job) in FINISHED, timeout, f"job {job} to end", poll=0.5)

    def state(self, job: str) -> str:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=self.env, capture_output=True,
                             text=True).stdout.split()
        return out[0] if out else "GONE"

    def on_node(self, node: str, *argv: str) -> str:
        """`argv` in `node`'s mount namespace (its slurmd's, which its jobs and containers start from)."""
        return subprocess.run(["nsenter", "-t", str(self.slurmd(node)), "-m", *argv], capture_output=True,
                              text=True, check=True).stdout

    def slurmd(self, node: str) -> int:
        return next(p["pid"] for p in read_registry(self.cluster.spec.name)["processes"]
                    if p["role"] == f"slurmd {node}")

    def containers(self, node: str) -> list[str]:
        return [c for c in self.on_node(node, str(ENROOT_BIN / "enroot"), "list").split() if c.startswith("pyxis_")]

    def complete(self, node: str) -> bool:
        """The kept container holds every file of the image, and its mark is the build's."""
        count = len(self.on_node(node, "find", f"{DATA}/{self.kept}", "-mindepth", "1").splitlines())
        mark = self.on_node(node, "cat", f"{DATA}/.slipway/{self.kept}.ready").strip()
        return count >= files_in(self.squashfs) and mark == self.build_hash

    def slurmd_log(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.cluster.spec.log_dir.glob("slurmd-*.log"))

    def unpacked_by_pyxis(self) -> int:
        """How many containers pyxis itself unpacked: none, while every job's node check readies
        the kept one first."""
        return self.slurmd_log().count("pyxis: creating container filesystem")

    def remove_containers(self) -> subprocess.CompletedProcess:
        return self.slipway("image", "containers", "tiny_cpu", *self.image, "--nodes", ",".join(self.nodes),
                            "--remove")


def files_in(squashfs: str) -> int:
    listing = subprocess.run(["unsquashfs", "-l", squashfs], capture_output=True, text=True, check=True).stdout
    return sum(1 for line in listing.splitlines() if line.startswith("squashfs-root/"))


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Lab:
    """The tier's project (a checkout of its own: its code can change), its image built once, and a
    2-node cluster whose nodes load pyxis, with the runtime's enroot first on every PATH."""
    from test_image import TEST_BASE, ensure_test_base, ensure_wheelhouse
    from containers.context import build_root
    from containers.project import Project

    tmp = tmp_path_factory.mktemp("pyxis")
    project = tmp / "project"
    shutil.copytree(ROOT / "configs", project / "configs")
    checkout(project)
    path = f"{ENROOT_BIN}{os.pathsep}{os.environ['PATH']}"
    env = {k: v for k, v in os.environ.items()  # as a user's shell has it: bytecode cached
           if not k.startswith(("XDG_", "ENROOT_", "SLURM_", "SLIPWAY_")) and k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PATH=path, SLIPWAY_PROJECT=str(project))
    ensure_test_base()
    image = [f"image.base_image={TEST_BASE}", "image.flash_attn=false", f"image.wheelhouse={ensure_wheelhouse()}",
             "image.isolation=chroot", f"image.output_dir={tmp / 'images'}", "image.squash_options=-comp lz4"]
    build = subprocess.run([PY, "-m", "jobs", "image", "build", "tiny_cpu", *image], capture_output=True, text=True,
                           cwd=project, env=env, timeout=1800)
    assert build.returncode == 0, (build.stdout[-3000:], build.stderr[-3000:])
    record = json.loads((tmp / "images" / "slipway.json").read_text())
    spec = ClusterSpec(state_dir=default_state_dir("pyxis"), nodes=2, cpus=6, name="slpwx", node_prefix="slpwx-node",
                       ctl_host="slpwx-ctl", subnet="10.213.3", ctld_port=6947, slurmd_port=6948,
                       first_job_id=700000, plugstack=PLUGSTACK, node_private=NODE_PRIVATE)
    with pytest.MonkeyPatch.context() as mp:  # the daemons' PATH: pyxis runs the enroot it finds there
        mp.setenv("PATH", path)
        cluster = LocalSlurmCluster(spec).up()
    try:
        named = f"pyxis_slipway-{Project.of(build_root(project, 'containers/Dockerfile')).token}-"
        with kept_up(cluster, path):  # as the session cluster: before each test's fixtures, the readme's too
            yield Lab(cluster, project, {**env, **cluster.env()}, image, record["squashfs"], record["hash"],
                      f"{named}i{record['hash'][:16]}")
    finally:
        cluster.down()


def train_losses(run_dir: Path) -> list[tuple[int, float]]:
    """Every training step's (step, loss) as logged, a resumed run's repeated steps included."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r.get("kind") == "train"]


def rank_process(lab: Lab, name: str, node: str | None = None, local_rank: str | None = None) -> tuple[int, dict]:
    """A trainer rank of run `name` (its pid and environment), on `node` with `local_rank` if given."""
    config = str(lab.run_dir(name) / "config.yaml").encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        except (OSError, ValueError):
            continue
        if (argv[1:5] == [b"-m", b"trainer", b"--config", config] and b"RANK" in env
                and (node is None or env.get(b"SLURMD_NODENAME") == node.encode())
                and (local_rank is None or env.get(b"LOCAL_RANK") == local_rank.encode())):
            return int(pid), {k.decode(): v.decode() for k, v in env.items()}
    pytest.fail(f"no rank of {name} on {node or 'any node'} (local rank {local_rank or 'any'})")


# ------------------------------------------------------------------ first jobs of a build at once


def test_first_jobs_of_a_build_start_at_once_and_one_unpacks_on_each_node(lab: Lab):
    """Two runs and a sweep's two array tasks of a new build (the tier's first jobs), released at
    the same moment on the same nodes: all train; on each node one of them unpacked the container,
    whole, before any step, and the others started in it; pyxis unpacked none."""
    if any(lab.containers(n) for n in lab.nodes):  # run on its own, after others
        removed = lab.remove_containers()
        assert removed.returncode == 0 and not [n for n in lab.nodes if lab.containers(n)], removed.stdout
    jobs = [lab.submit(name, *TINY, "slurm.extra=[--hold]") for name in ("pyxa", "pyxb")]
    sweep = lab.slipway("sweep", "tiny_cpu", "--name", "pyxs", *TINY, "container.runtime=pyxis", *lab.image,
                        "train.lr=[3e-3, 1e-3]", "slurm.extra=[--hold]")
    assert sweep.returncode == 0, (sweep.stdout[-3000:], sweep.stderr[-3000:])
    array = json.loads((lab.project / "runs" / ".sweeps" / "pyxs" / "sweep.json").read_text())["arrays"][0]["job_id"]
    lab.scontrol("release", ",".join([*jobs, array]))  # all at once
    for job in (*jobs, array):
        lab.wait_gone(job)
    unpacks = []
    for name, job in (("pyxa", jobs[0]), ("pyxb", jobs[1]), ("pyxs-lr3e-3", f"{array}_0"), ("pyxs-lr1e-3", f"{array}_1")):
        events = lab.events(name)
        assert f"job {job} end exit 0" in events and "retry" not in events and "preflight failed" not in events, events
        assert (lab.run_dir(name) / "checkpoints" / "step-000006" / "COMPLETE").is_file()
        unpacks += re.findall(r"unpacked the image into the kept container \S+: (.*)", events)
    on = [node for line in unpacks for node in re.findall(r"(slpwx-node\d) in \d+ s", line)]
    assert sorted(on) == lab.nodes, unpacks
    assert all(lab.containers(n) == [lab.kept] and lab.complete(n) for n in lab.nodes)
    assert lab.unpacked_by_pyxis() == 0


# ------------------------------------------------------------------ the README's path


@pytest.fixture(scope="module")
def readme(lab: Lab) -> subprocess.CompletedProcess:
    """The README's pyxis path, `slipway submit ... container.runtime=pyxis --show-logs`, run once."""
    r = lab.slipway("submit", "tiny_cpu", "--run-name", "pyx", *LONG, "container.runtime=pyxis", *lab.image,
                    "--show-logs")
    assert r.returncode == 0, (r.stdout[-4000:], r.stderr[-4000:])
    return r


@pytest.fixture(scope="module")
def reference(lab: Lab, readme) -> dict[int, float]:
    """The README path's losses, uninterrupted: what every interrupted and resumed run of LONG gives."""
    return dict(train_losses(lab.run_dir("pyx")))


def test_the_readme_path_trains_in_the_image_on_both_nodes_and_draws_its_curves(lab: Lab, readme, reference):
    run_dir = lab.run_dir("pyx")
    assert sorted(reference) == list(range(1, 41)) and (run_dir / "checkpoints" / "step-000040" / "COMPLETE").is_file()
    # The host's python3 has no torch: training can only have run in the image.
    assert subprocess.run(["/usr/bin/python3", "-c", "import torch"], capture_output=True).returncode != 0
    script = (run_dir / "job.sbatch").read_text()
    assert f"--container-image={lab.squashfs}" in script and f"{run_dir}:{run_dir}" in script
    manifest = json.loads((run_dir / "manifest.json").read_text())
    code = manifest["code"]["dir"]
    assert manifest["image"]["path"] == lab.squashfs and f"{code}:{code}:ro" in script
    events = lab.events("pyx")
    # The preflight's all-reduce ran in the containers, as the training step's first collective.
    assert re.search(r" preflight ok on \S+: all-reduce of 4 MiB over 4 ranks on 2 node\(s\) \(gloo\)", events), events
    # Every step started in the build's container, which each node's check readied first: the
    # node step, training on both nodes, the curves' step.
    job = manifest["submissions"][0]["job_id"]
    assert lab.unpacked_by_pyxis() == 0 and lab.slurmd_log().count("pyxis: reusing existing container") >= 5
    assert all(lab.containers(n) == [lab.kept] and lab.complete(n) for n in lab.nodes)
    # The run's end draws its curves in the image, and its log says where, in trainer/plot.py's
    # words; --show-logs follows it to its last line.
    log = (run_dir / "logs" / f"{job}.out").read_text()
    assert log.endswith(f"curves: {run_dir / 'curves.png'}\nslipway: job {job} ended: completed (exit 0)\n"), log[-2000:]
    assert f"slipway: job {job} ended: completed (exit 0)" in readme.stdout and "_step_signal" not in log, \
        readme.stdout[-2000:]
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ the seal on the node


@pytest.mark.parametrize("broken", ["code", "image"])
def test_what_changed_after_submission_is_refused_on_the_node_naming_it(lab: Lab, broken: str):
    """A file of the code snapshot edited, or the squashfs moved, while the job waits: the node's
    check names it, the job ends at once with exit 2, no retry, no node blamed."""
    name = f"pyxseal{broken}"
    job = lab.submit(name, *TINY, "slurm.extra=[--hold]")
    if broken == "code":
        target = Path(json.loads((lab.run_dir(name) / "manifest.json").read_text())["code"]["dir"]) / "trainer" / "train.py"
        kept = target.read_bytes()
        target.chmod(0o644)
        target.write_bytes(kept + b"\n# edited after submission\n")
        said = f"verification failed: {target} differs from the file submitted (on slpwx-node"
    else:
        target, kept = Path(lab.squashfs), None
        os.rename(target, target.with_name("aside.sqsh"))
        said = f"verification failed: the image {target} is not there (removed or moved after submission"
    try:
        asked = time.monotonic()
        lab.scontrol("release", job)
        lab.wait_gone(job)
        took = time.monotonic() - asked
    finally:
        if kept is None:
            os.rename(target.with_name("aside.sqsh"), target)
        else:  # the snapshot is shared by every run of this code: as it was
            target.write_bytes(kept)
            target.chmod(0o444)
    print(f"{broken} changed after submission -> job ended: {took:.1f} s")
    events = lab.events(name)
    assert said in events and f"job {job} end exit 2" in events, events
    assert "retry" not in events and "preflight" not in events and not (lab.run_dir(name) / "metrics.jsonl").exists()
    assert took < 120  # seconds, not a preflight's time limit (300 s)
    assert not list((lab.project / "runs" / ".nodes").glob("*/*"))  # no node remembered as bad


# ------------------------------------------------------------------ a node whose container cannot start


def test_a_node_whose_container_cannot_start_is_told_as_it_was(lab: Lab):
    """The token cache (a mount of every step's container) missing on one node: its node step fails
    in seconds without a report, and that is what events.log and the node's record say, not a
    preflight time limit that never passed. The next submission keeps the node in (the job needs
    both) and says so in words that add up."""
    cache = lab.project / ".cache"
    cache.mkdir(exist_ok=True)  # made by the tier's first training run; this test may run alone
    lab.on_node(lab.nodes[1], "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(cache))
    try:
        job = lab.submit("pyxnocache", *TINY)
        lab.wait_gone(job, 600)
    finally:
        lab.on_node(lab.nodes[1], "umount", str(cache))
    events = lab.events("pyxnocache")
    said = re.search(rf"job {job} preflight failed on {lab.nodes[1]}: no report: the step ended after (\d+) s "
                     r"\(exit \d+\) without one", events)
    assert said and int(said.group(1)) < 300 and "within 300 s" not in events, events
    assert f"job {job} end exit 5" in events and f"preflight failed on {lab.nodes[0]}" not in events, events
    from jobs.slurm.bad_nodes import BadNode

    record = BadNode.parse((lab.project / "runs" / ".nodes" / "default" / lab.nodes[1]).read_text())
    assert record.reason.startswith("no preflight report: the step ended after "), record
    dry = lab.slipway("submit", "tiny_cpu", "--run-name", "pyxnocache2", *TINY, "container.runtime=pyxis", *lab.image,
                      "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert (f"not excluding {lab.nodes[1]} (preflight, since" in dry.stderr + dry.stdout
            and f"the job needs 2 node(s) and partition debug has 2 usable, {lab.nodes[1]} included"
            in dry.stderr + dry.stdout), (dry.stdout[-3000:], dry.stderr[-3000:])
    forget = lab.slipway("nodes", "--forget", lab.nodes[1])
    assert forget.returncode == 0, forget.stderr


# ------------------------------------------------------------------ a killed rank, a frozen rank


def test_a_killed_rank_and_a_frozen_one_are_named_and_the_run_resumes_exactly(lab: Lab, reference):
    """LONG again, its first job losing a rank to SIGKILL, its second (the resubmission) a rank frozen
    with SIGSTOP: each end names what happened, and the third job completes the run, every step
    logged by any of them (the repeated ones too) the reference's loss, bit for bit."""
    name, run_dir = "pyxkill", lab.run_dir("pyxkill")
    first = lab.submit(name, *LONG)
    wait_for(lambda: complete_checkpoints(run_dir) and steps_logged(run_dir)[-1] >= complete_checkpoints(run_dir)[-1] + 2,
             300, "a checkpoint and two steps after it")
    pid, env = rank_process(lab, name)
    os.kill(pid, signal.SIGKILL)
    lab.wait_gone(first, 300)
    said = f"job {first} rank failed: rank {env['RANK']} on {env['SLURMD_NODENAME']} was killed by SIGKILL (exit 137)"
    assert said in lab.events(name), lab.events(name)

    second = lab.submit(name, *LONG)
    restart = len(steps_logged(run_dir))
    wait_for(lambda: len(steps_logged(run_dir)) >= restart + 2, 300, "two steps of the resubmission")
    pid, env = rank_process(lab, name, lab.nodes[1], "1")
    os.kill(pid, signal.SIGSTOP)
    try:
        lab.wait_gone(second, 600)
    finally:
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)
    events = lab.events(name)
    assert f"job {second} end exit 4" in events, events
    assert re.search(rf"job {second} hang: .*; not answering in time: 1 of the 2 ranks on {lab.nodes[1]}\n", events), events
    from jobs.slurm.bad_nodes import BadNode

    record = BadNode.parse((lab.project / "runs" / ".nodes" / "default" / lab.nodes[1]).read_text())
    assert record.reason == "hang: 1 of its 2 ranks wrote no stack dump in time", record

    third = lab.slipway("submit", "tiny_cpu", "--run-name", name, *LONG, "container.runtime=pyxis", *lab.image,
                        "--show-logs")
    assert third.returncode == 0, (third.stdout[-3000:], third.stderr[-3000:])
    said = f"not excluding {lab.nodes[1]} (hang, since"  # the job cannot do without it, and says so in words that add up
    assert said in third.stdout + third.stderr, (third.stdout[-3000:], third.stderr[-3000:])
    assert f"the job needs 2 node(s) and partition debug has 2 usable, {lab.nodes[1]} included" in third.stdout + third.stderr
    logged = train_losses(run_dir)
    assert len(logged) > 40 and {step for step, _ in logged} == set(reference)
    assert [(step, loss) for step, loss in logged if loss != reference[step]] == []
    assert not (lab.project / "runs" / ".nodes" / "default" / lab.nodes[1]).exists()  # a clean preflight cleared it


# ------------------------------------------------------------------ slipway run in an allocation


def test_ctrl_c_of_slipway_run_saves_and_the_printed_command_resumes_exactly(lab: Lab, reference):
    args = ["run", "tiny_cpu", "--run-name", "pyxint", *LONG, "container.runtime=pyxis", *lab.image]
    run_dir = lab.run_dir("pyxint")
    proc = subprocess.Popen(["salloc", "--nodes=2", "--ntasks-per-node=2", PY, "-m", "jobs", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=lab.project, env=lab.env,
                            preexec_fn=default_signals)
    wait_for(lambda: len(steps_logged(run_dir)) >= 3 or proc.poll() is not None, 600, "three steps")
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    launcher = subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "jobs run"], capture_output=True, text=True)
    os.kill(int(launcher.stdout.split()[0]), signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 75, out[-3000:]
    lines = out.splitlines()
    said = [line for line in lines[next(i for i, line in enumerate(lines) if line.startswith("Ctrl-C: ")):]
            if not line.startswith("salloc: ")]
    saved = complete_checkpoints(run_dir)
    assert len(said) == 2 and saved and said[1].startswith(f"interrupted (Ctrl-C) at step {saved[-1]} and saved it: `"), said
    assert "Traceback" not in out and "srun: error" not in out, out[-3000:]
    command = said[1].split("`")[1]
    again = subprocess.run(["salloc", "--nodes=2", "--ntasks-per-node=2", "bash", "-c", command], capture_output=True, text=True,
                           cwd=lab.project, env=lab.env, timeout=600)
    assert again.returncode == 0, (again.stdout[-3000:], again.stderr[-3000:])
    logged = train_losses(run_dir)
    assert [step for step, _ in logged] == list(range(1, 41))  # resumed right after the saved step
    assert [(step, loss) for step, loss in logged if loss != reference[step]] == []


def test_warm_ranks_run_changed_code_in_the_container_already_unpacked(lab: Lab):
    """`slipway run` twice in one allocation: the first starts a warm process per node (in the
    build's container), the second, after a one-line change of the checkout, starts its ranks
    from them with the new code; no container is unpacked for either."""
    trainer = lab.project / "trainer" / "train.py"
    original = trainer.read_text()
    alloc = subprocess.run(["salloc", "--nodes=2", "--ntasks-per-node=2", "--no-shell"], capture_output=True,
                           text=True, env=lab.env, timeout=300)
    job = alloc.stderr.split("Granted job allocation ")[1].split()[0]
    inside = {**lab.env, "SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": "slpwx-node[1-2]", "SLURM_JOB_NUM_NODES": "2",
              "SLURM_JOB_CPUS_PER_NODE": "2(x2)"}

    def run(name: str, word: str) -> tuple[str, str]:
        mark_parent(lab.project, word)
        r = subprocess.run([PY, "-m", "jobs", "run", "tiny_cpu", "--run-name", name, *TINY, "container.runtime=pyxis",
                            *lab.image], capture_output=True, text=True, timeout=600, cwd=lab.project, env=inside)
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
        (got, parent, cmdline), = [line.split(" ", 2) for line in (lab.run_dir(name) / "code-marks").read_text().splitlines()]
        assert got == word and "warm.py serve " in cmdline and "/slipway-warm-" in cmdline, cmdline
        return parent, lab.events(name)

    try:
        parent, events = run("pyxwarm1", "one")
        assert f"warm: started the warm processes on {' '.join(lab.nodes)}" in events, events
        again, events = run("pyxwarm2", "two")
        assert len(re.findall(r"warm: rank \d on \S+ started warm", events)) == 4 and "cold" not in events, events
        # The node checks ran in the warm processes' container, asked from the host by its python3
        # with the verification: no srun step entered the container for them.
        said = "".join(log.read_text() for log in (lab.run_dir("pyxwarm2") / "logs").glob("run-*.out"))
        assert len(re.findall(r"the node step started warm \(pid \d+, asked from the host\)", said)) == 2, said[-3000:]
        assert again == parent
        # The warm process runs in a container: a mount namespace of its own, not its node's.
        assert os.stat(f"/proc/{parent}/ns/mnt").st_ino not in {os.stat(f"/proc/{lab.slurmd(n)}/ns/mnt").st_ino
                                                                  for n in lab.nodes}
        assert "unpacked the image" not in events and lab.unpacked_by_pyxis() == 0
    finally:
        trainer.write_text(original)
        subprocess.run(["scancel", job], env=lab.env)
    wait_for(lambda: not Path(f"/proc/{parent}").exists(), 120, "the warm processes to end with the allocation")


# ------------------------------------------------------------------ slipway image containers


def test_the_containers_are_listed_and_removed_on_every_node(lab: Lab):
    """A job in the kept container cancelled, then `slipway image containers`: every node's
    containers of this project listed, then removed, each removal said as it goes; a node that
    cannot tell (no enroot on the command's PATH) is said, never taken for one with none."""
    job = lab.submit("pyxc", *TINY, "train.steps=100000", "checkpoint.interval=100000")
    wait_for(lambda: '"train"' in ((lab.run_dir("pyxc") / "metrics.jsonl").read_text()
                                    if (lab.run_dir("pyxc") / "metrics.jsonl").exists() else ""), 600, "training")
    stopped = lab.slipway("cancel", "pyxc")
    assert stopped.returncode == 0, (stopped.stdout, stopped.stderr)
    lab.wait_gone(job)
    events = lab.events("pyxc")
    assert "cancelled by slipway cancel" in events and "end exit 140" in events, events

    nodes = ",".join(lab.nodes)
    no_enroot = {**lab.env, "PATH": os.environ["PATH"].replace(f"{ENROOT_BIN}{os.pathsep}", "")}
    blind = lab.slipway("image", "containers", "tiny_cpu", *lab.image, "--nodes", nodes, env=no_enroot)
    assert blind.returncode == 1 and "none" not in blind.stdout.split(), blind.stdout
    assert all(f"{n}: enroot is not on this node's PATH" in blind.stdout for n in lab.nodes), blind.stdout

    listed = lab.slipway("image", "containers", "tiny_cpu", *lab.image, "--nodes", nodes)
    assert listed.returncode == 0 and all(f"{n}: would remove {lab.kept}" in listed.stdout for n in lab.nodes), listed.stdout
    t0 = time.monotonic()
    removed = lab.remove_containers()
    print(f"image containers --remove: {time.monotonic() - t0:.1f} s\n{removed.stdout}")
    assert removed.returncode == 0, (removed.stdout, removed.stderr)
    for n in lab.nodes:
        assert f"{n}: removed {lab.kept}" in removed.stdout, removed.stdout
        assert re.search(rf"{n}: deleted the files of {lab.kept}.* in \d+ s", removed.stdout), removed.stdout
    assert not [n for n in lab.nodes if lab.containers(n)], {n: lab.containers(n) for n in lab.nodes}
    after = lab.slipway("image", "containers", "tiny_cpu", *lab.image, "--nodes", nodes)
    assert all(f"{n}: none of this project's" in after.stdout for n in lab.nodes), after.stdout
