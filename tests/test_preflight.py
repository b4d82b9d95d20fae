"""The preflight's all-reduce inside the training step (trainer/preflight.py AllReduceGate): the
batch script asks for it through PREFLIGHT_ENV; rank 0 records a pass in events.log, a failing
rank reports why among the step's exit reports and exits PREFLIGHT_EXIT before any training.
What the batch script does with either is tests/test_hang_script.py; the real thing on the
local Slurm is tests/test_hang_slurm.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.preflight import AllReduceGate
from common.events import read_events
from common.rundir import PREFLIGHT_ENV, PREFLIGHT_EXIT, PREFLIGHT_FAILED_FILE
from trainer_helpers import ROOT, clean_env, read_metrics, tiny_config, write_run

TESTS = Path(__file__).resolve().parent


def gate_env(tmp_path: Path, value: str = "1 60") -> dict[str, str]:
    (tmp_path / "exits").mkdir(exist_ok=True)
    return {PREFLIGHT_ENV: value, "SLIPWAY_RUN_DIR": str(tmp_path), "SLIPWAY_EXITS": str(tmp_path / "exits"),
            "SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "node[1-2]", "RANK": "1"}


def test_no_gate_unless_the_batch_script_asks():
    assert AllReduceGate.from_environ({}) is None
    gate = AllReduceGate.from_environ({PREFLIGHT_ENV: "64 300"})
    assert (gate.megabytes, gate.timeout_s) == (64.0, 300.0)
    with pytest.raises(ValueError, match=PREFLIGHT_ENV):
        AllReduceGate.from_environ({PREFLIGHT_ENV: "64"})


def test_a_failing_rank_reports_once_and_exits(tmp_path, capsys):
    exits = []
    gate = AllReduceGate(1, 60, gate_env(tmp_path), exit=exits.append)
    gate.fail("rank 1 on node2: RuntimeError: Connection closed by peer")
    gate.fail("a later rank's report")  # the first failing rank's report is kept
    assert exits == [PREFLIGHT_EXIT, PREFLIGHT_EXIT]
    report = (tmp_path / "exits" / PREFLIGHT_FAILED_FILE).read_text()
    assert report == "rank 1 on node2: RuntimeError: Connection closed by peer\n"
    assert "slipway-preflight-allreduce fail: rank 1 on node2" in capsys.readouterr().err


def test_a_report_that_cannot_be_written_still_exits(tmp_path, monkeypatch):
    """A full disk fails the report's write, never the exit: a rank must not wait on a dead group."""
    exits = []

    def full(fd, *args, **kwargs):
        os.close(fd)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fdopen", full)
    AllReduceGate(1, 60, gate_env(tmp_path), exit=exits.append).fail("rank 1 on node2: timed out")
    assert exits == [PREFLIGHT_EXIT]


def test_no_result_within_the_bound_is_a_failure(tmp_path):
    exits = []
    AllReduceGate(1, 0.2, gate_env(tmp_path), exit=exits.append).arm()  # the group never forms
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.02)
    assert exits == [PREFLIGHT_EXIT]
    report = (tmp_path / "exits" / PREFLIGHT_FAILED_FILE).read_text()
    assert report.startswith("the all-reduce across every rank gave no result within 0.2 s (rank 1 on ")


def test_a_passed_check_is_disarmed(tmp_path, monkeypatch):
    import trainer.preflight as preflight

    exits = []
    monkeypatch.setattr(preflight, "sum_across_ranks", lambda mb, iters, device: (True, "stand-in"))
    gate = AllReduceGate(1, 0.3, {**gate_env(tmp_path), "RANK": "0"}, exit=exits.append).arm()
    gate.check(None)
    time.sleep(0.6)
    assert exits == [] and not (tmp_path / "exits" / PREFLIGHT_FAILED_FILE).exists()
    assert [(e.job, e.text) for e in read_events(tmp_path)] == [("41", "preflight ok on node[1-2]: stand-in")]


def _torchrun(tmp_path: Path, driver: str, config: Path, value: str = "1 60"):
    import subprocess

    script = tmp_path / "driver.py"
    script.write_text(driver)
    env = clean_env(**gate_env(config.parent, value))
    env.pop("RANK")
    env["PYTHONPATH"] = f"{ROOT}:{TESTS}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), str(config)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)


@pytest.mark.multiproc
def test_the_training_step_runs_the_all_reduce_first_and_records_it(tmp_path):
    config = write_run(tmp_path, "r1", tiny_config(parallel={"dp": 2}, train={"steps": 2}))
    proc = _torchrun(tmp_path, "import sys\nfrom trainer_helpers import main\nsys.exit(main())\n", config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [(e.job, e.text) for e in read_events(config.parent)]
    assert len(events) == 1 and events[0][0] == "41", events
    assert events[0][1].startswith("preflight ok on node[1-2]: all-reduce of 1 MiB over 2 ranks on 1 node(s) (gloo): ")
    assert [r["step"] for r in read_metrics(config.parent)] == [1, 2]


@pytest.mark.multiproc
def test_a_peer_lost_during_the_all_reduce_fails_it_before_any_training(tmp_path):
    """Rank 1 vanishes once the group is up: rank 0's collective fails (or outlives the bound),
    it reports and exits PREFLIGHT_EXIT; nothing is trained."""
    driver = ("import os, sys\nimport trainer.preflight as preflight\n"
              "if os.environ['RANK'] == '1':\n"
              "    preflight.sum_across_ranks = lambda *a: os._exit(0)\n"
              "from trainer_helpers import main\nsys.exit(main())\n")
    config = write_run(tmp_path, "r1", tiny_config(parallel={"dp": 2}, train={"steps": 2}))
    proc = _torchrun(tmp_path, driver, config, value="1 20")
    assert proc.returncode != 0
    report = (config.parent / "exits" / PREFLIGHT_FAILED_FILE).read_text()
    assert report.startswith(("rank 0 on ", "the all-reduce across every rank gave no result within 20 s")), report
    assert f"exitcode  : {PREFLIGHT_EXIT}" in proc.stderr or f"exitcode : {PREFLIGHT_EXIT}" in proc.stderr, \
        proc.stderr[-3000:]
    assert not (config.parent / "metrics.jsonl").exists()
    assert not [e for e in read_events(config.parent) if e.text.startswith("preflight ok")]


@pytest.mark.multiproc
def test_the_all_reduce_step_of_a_train_script_runs_in_a_group_of_its_own(tmp_path):
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "trainer.preflight", "allreduce", "--megabytes", "1", "--timeout", "60"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=clean_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("slipway-preflight-allreduce ok: all-reduce of 1 MiB over 2 ranks on 1 node(s) "
                                  "(gloo): "), proc.stdout


# ---- NUMA binding: torchrun --numa-binding runs every worker under numactl ----------------

# torchrun as the batch script starts it (jobs/slurm/ranks.py torchrun_argv), in a launcher
# process told which NUMA node "its GPU" is on: torch looks that up in sysfs by the GPU's PCI
# address, and this machine has no GPU. Everything else is torch's own: the binding it computes
# and the numactl command line it wraps each worker in.
NUMA_LAUNCHER = """import sys
import torch.numa.binding as binding
binding._get_numa_node_index_for_gpu_index = lambda *, gpu_index: 0
from torch.distributed.run import main
sys.exit(main())
"""
# numactl first on PATH: records how torch called it, then runs the real one.
NUMACTL_SHIM = '#!/bin/sh\necho "$@" >> "{log}"\nexec "{real}" "$@"\n'


def numa_launch(tmp_path: Path, path: str, procs: int) -> tuple[subprocess.CompletedProcess, Path]:
    from jobs.config import load_config
    from jobs.slurm.ranks import torchrun_argv

    cfg = load_config("configs/tiny_wikitext.yaml", ["run.name=numa", "launch.launcher=torchrun"])
    assert cfg.binds_numa  # the flagship's preset binds each rank to its GPU's NUMA node, here by torchrun
    argv = torchrun_argv(cfg, nnodes="1", rdzv=["--standalone"])
    assert argv[1:3] == ["-m", "torch.distributed.run"] and "--numa-binding=node" in argv
    launcher = tmp_path / "launcher.py"
    launcher.write_text(NUMA_LAUNCHER)
    argv = [sys.executable, str(launcher), *argv[3:]]
    argv = [a if not a.startswith("--nproc-per-node=") else f"--nproc-per-node={procs}" for a in argv]
    config = write_run(tmp_path, "numa", tiny_config(parallel={"dp": procs}, train={"steps": 2,
                                                                                   "grad_accum_steps": 2}))
    env = clean_env(PATH=path, OMP_NUM_THREADS="1")
    proc = subprocess.run([*argv, str(TESTS / "trainer_helpers.py"), str(config)], capture_output=True, text=True,
                          timeout=240, env=env, cwd=ROOT)
    return proc, config.parent


def node_check(tmp_path: Path, path: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.preflight", "node", "--run-dir", str(tmp_path),
                           "--checkpoint-dir", str(tmp_path / "checkpoints"), "--checkpoint-bytes", "1",
                           "--numa-binding"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=clean_env(PATH=path, SLURMD_NODENAME="nid007"))


@pytest.mark.multiproc
@pytest.mark.skipif(shutil.which("numactl") is None, reason="needs numactl (Debian package numactl; .ci/run installs it)")
def test_torchrun_numa_binding_runs_every_rank_under_numactl(tmp_path):
    log = tmp_path / "numactl.log"
    shim = tmp_path / "bin" / "numactl"
    shim.parent.mkdir()
    shim.write_text(NUMACTL_SHIM.format(log=log, real=shutil.which("numactl")))
    shim.chmod(0o755)
    path = f"{shim.parent}:{os.environ['PATH']}"
    proc, run = numa_launch(tmp_path, path, procs=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    calls = log.read_text().splitlines()
    allowed = ",".join(map(str, sorted(os.sched_getaffinity(0))))  # node 0's CPUs (this machine has one node)
    assert len(calls) == 2 and all(c.startswith("--physcpubind=") and "trainer_helpers.py" in c for c in calls), calls
    assert {c.split()[0].split("=", 1)[1] for c in calls} <= {allowed, _ranges(allowed)}, calls
    ok = node_check(tmp_path, path)
    assert ok.returncode == 0 and ok.stdout.startswith("slipway-preflight nid007 ok: ") and "numactl runs" in ok.stdout
    assert "slipway-preflight-log nid007: numactl --show: policy: " in ok.stderr  # the log has what it showed


@pytest.mark.multiproc
def test_without_numactl_torchrun_starts_no_rank_and_the_preflight_names_the_node_and_fix(tmp_path):
    """torch does not fall back to no binding: torchrun stops before any rank starts. The
    preflight's node step, which runs first, says so in one line."""
    empty = tmp_path / "empty-path"
    empty.mkdir()
    proc, run = numa_launch(tmp_path, str(empty), procs=2)
    assert proc.returncode != 0
    assert "numactl CLI is required for NUMA binding" in proc.stderr
    assert not (run / "metrics.jsonl").exists()  # no rank ever ran
    fail = node_check(tmp_path, str(empty))
    assert fail.returncode == PREFLIGHT_EXIT
    (line,) = fail.stdout.splitlines()
    assert line.startswith("slipway-preflight nid007 fail: numactl is not in this node's container: the launch binds "
                           "each rank to its GPU's NUMA node (launch.preset with torchrun --numa-binding)"), line
    assert "`slipway image build CONFIG` installs numactl" in line and "launch.preset: none" in line


def _ranges(cpus: str) -> str:
    """numactl's range form of a comma list of CPUs: 0,1,2,5 -> 0-2,5."""
    nums, out = sorted(int(c) for c in cpus.split(",")), []
    start = prev = nums[0]
    for n in nums[1:] + [None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        out.append(f"{start}-{prev}" if prev > start else str(start))
        if n is not None:
            start = prev = n
    return ",".join(out)


# ---- a GPU's NUMA node: one with no CPUs cannot be bound to ------------------------------------

def fake_sysfs(root: Path, nodes: dict[int, str], gpus: dict[str, int]) -> Path:
    """sysfs as the kernel lays it out: node N's cpulist, each PCI device's numa_node."""
    for node, cpus in nodes.items():
        (root / "devices" / "system" / "node" / f"node{node}").mkdir(parents=True)
        (root / "devices" / "system" / "node" / f"node{node}" / "cpulist").write_text(cpus + "\n")
    for address, node in gpus.items():
        (root / "bus" / "pci" / "devices" / address).mkdir(parents=True)
        (root / "bus" / "pci" / "devices" / address / "numa_node").write_text(f"{node}\n")
    return root


# A GH200 node: 4 Grace nodes of 72 cores, then each GPU's HBM as a node of its own without CPUs.
GH200_NODES = {0: "0-71", 1: "72-143", 2: "144-215", 3: "216-287", **{n: "" for n in range(4, 12)}}
GH200_GPUS = ["0009:01:00.0", "0019:01:00.0", "0029:01:00.0", "0039:01:00.0"]


def test_each_gpu_is_bound_to_the_cpus_of_its_numa_node(tmp_path):
    from trainer.topology import numa_binding

    sysfs = fake_sysfs(tmp_path, GH200_NODES, dict(zip(GH200_GPUS, range(4))))
    ok, lines = numa_binding(GH200_GPUS, set(range(288)), sysfs)
    assert ok and lines == [f"GPU {i} ({a}) on NUMA node {i} ({72 * i}-{72 * i + 71})" for i, a in enumerate(GH200_GPUS)]
    ok, lines = numa_binding(GH200_GPUS[:1], set(range(8)) | {100}, sysfs)  # a cgroup of 9 cores
    assert ok and lines == ["GPU 0 (0009:01:00.0) on NUMA node 0 (0-7 of 0-71)"]
    one = fake_sysfs(tmp_path / "one", {0: "0-1"}, {"0000:00:04.0": -1})  # one node: the kernel says -1
    assert numa_binding(["0000:00:04.0"], {0, 1}, one) == (True, ["GPU 0 (0000:00:04.0) on NUMA node 0 (0-1)"])


@pytest.mark.parametrize("gpu_node, allowed, words", [
    (5, set(range(288)), "is on NUMA node 5, which has no CPUs (a node of memory alone, as a GH200's HBM)"),
    (1, set(range(72)), "is on NUMA node 1, which has no CPU this job may use (its CPUs 72-143, the job's 0-71)"),
])
def test_a_gpu_on_a_node_without_usable_cpus_is_refused_in_one_line(tmp_path, gpu_node, allowed, words):
    from trainer.topology import numa_binding

    sysfs = fake_sysfs(tmp_path, GH200_NODES, {GH200_GPUS[0]: 0, GH200_GPUS[1]: gpu_node})
    ok, lines = numa_binding(GH200_GPUS[:2], allowed, sysfs)
    assert not ok
    reason = lines[0]
    assert reason.startswith(f"GPU 1 ({GH200_GPUS[1]}) {words}: torchrun --numa-binding=node would bind its rank "
                             "to no core"), reason
    assert "launch.preset: none" in reason and "\n" not in reason
    assert lines[1].startswith("GPU 0 ") and lines[2].startswith("GPU 1 ")  # every GPU's node, for the log


def test_damaged_sysfs_entries_are_unknown_not_a_crash(tmp_path):
    from trainer.topology import cpu_set, numa_binding

    sysfs = fake_sysfs(tmp_path, {0: "0-3", 1: "garbage"}, {})
    ok, lines = numa_binding(["0000:3b:00.0"], {0, 1}, sysfs)  # no such device: torch's binding would fail on it
    assert not ok and lines[0].startswith(f"GPU 0's PCI device 0000:3b:00.0 is not in {sysfs}/bus/pci/devices")
    assert lines[1:] == ["GPU 0 (0000:3b:00.0) on NUMA node ? (no CPUs)"]
    assert cpu_set("0-2,8,10-11\n") == {0, 1, 2, 8, 10, 11} and cpu_set("\n") == set()
