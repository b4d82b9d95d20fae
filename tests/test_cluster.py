"""The real local Slurm cluster (`slipway cluster`, jobs/devcluster/): it starts, runs multi-node
jobs on distinct hosts, carries a torchrun c10d + gloo job across 2 nodes, and
leaves nothing behind."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.errors import ConfigError
from jobs.devcluster import host as cluster_host
from slurm_fixtures import cluster_pids, restart_dead_nodes, sbatch, wait_job
from jobs.devcluster import (ClusterSpec, LocalSlurmCluster, alive, default_state_dir, leftovers,
                          read_registry, render_slurm_conf, unavailable_reason)

pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]


def _script(path: Path, body: str) -> Path:
    # sbatch reads #SBATCH lines only up to the first command: they come first.
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)
    return path


def _completed(cluster: LocalSlurmCluster, job_id: str, out: Path, timeout: float = 90) -> str:
    info = wait_job(cluster, job_id, timeout=timeout)
    text = out.read_text() if out.exists() else "(no output file)"
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", \
        f"job {job_id}: {info.get('JobState')} exit {info.get('ExitCode')}\n{text}"
    return text


def test_nodes_idle_in_debug_partition(slurm_cluster: LocalSlurmCluster) -> None:
    assert slurm_cluster.spec.node_names == ["node1", "node2"]
    # The session's cluster: an earlier test's job may still be completing on it (a loaded machine
    # takes its time); the nodes are up and theirs once it is done.
    deadline = time.monotonic() + 300
    while slurm_cluster.node_states() != {"node1": "idle", "node2": "idle"} and time.monotonic() < deadline:
        time.sleep(1)
    assert slurm_cluster.node_states() == {"node1": "idle", "node2": "idle"}
    part = slurm_cluster.run("scontrol", "show", "partition", "debug", "-o").stdout
    assert "Default=YES" in part and "MaxTime=UNLIMITED" in part and "Nodes=node[1-2]" in part
    status = slurm_cluster.status()
    assert status["up"] and status["env"] == {"SLURM_CONF": str(slurm_cluster.spec.conf)}


def test_two_node_job_runs_on_distinct_hosts(slurm_cluster: LocalSlurmCluster, tmp_path: Path) -> None:
    script = _script(tmp_path / "hosts.sbatch", """\
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output=hosts-%j.out
set -euo pipefail
srun hostname
""")
    job_id = sbatch(slurm_cluster, script)
    assert job_id.isdigit()
    out = _completed(slurm_cluster, job_id, tmp_path / f"hosts-{job_id}.out")
    assert sorted(out.split()) == ["node1", "node2"]


def test_a_slurmd_that_aborted_is_started_again_and_its_node_serves_jobs(slurm_cluster: LocalSlurmCluster,
                                                                         tmp_path: Path) -> None:
    """What the test session does before each test after Slurm 22.05's slurmd aborted on a heap
    check (seen once: node2 DOWN for every later job): start it again, the node back in service."""
    (daemon,) = [p for p in read_registry(slurm_cluster.spec.name)["processes"] if p["role"] == "slurmd node2"]
    os.kill(daemon["pid"], signal.SIGABRT)  # as glibc's malloc_printerr does
    deadline = time.monotonic() + 10
    while alive(daemon["pid"], daemon["start"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert restart_dead_nodes(slurm_cluster) == ["node2"]
    assert restart_dead_nodes(slurm_cluster) == []  # nothing else to do
    assert slurm_cluster.node_states()["node2"] in ("idle", "mixed", "allocated")
    assert slurm_cluster.status()["up"]
    test_two_node_job_runs_on_distinct_hosts(slurm_cluster, tmp_path)


GLOO_CHECK = """\
import json, os, socket, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": world, "host": socket.gethostname(), "sum": total.item()}, f)
dist.destroy_process_group()
"""


def test_torchrun_c10d_gloo_all_reduce_across_two_nodes(slurm_cluster: LocalSlurmCluster,
                                                        tmp_path: Path) -> None:
    (tmp_path / "gloo_check.py").write_text(GLOO_CHECK)
    results = tmp_path / "results"
    results.mkdir()
    # MASTER_ADDR is a hostname (node1): c10d decides which agent hosts the store
    # by comparing it with each node's own hostname.
    script = _script(tmp_path / "gloo.sbatch", f"""\
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output=gloo-%j.out
#SBATCH --time=3
set -euo pipefail
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
MASTER_PORT=$((29500 + SLURM_JOB_ID % 1000))
srun {shlex.quote(sys.executable)} -m torch.distributed.run --nnodes=2 --nproc-per-node=2 \\
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \\
    gloo_check.py {shlex.quote(str(results))}
""")
    job_id = sbatch(slurm_cluster, script)
    _completed(slurm_cluster, job_id, tmp_path / f"gloo-{job_id}.out", timeout=100)
    ranks = [json.loads((results / f"rank{r}.json").read_text()) for r in range(4)]
    assert {r["world"] for r in ranks} == {4}
    assert {r["sum"] for r in ranks} == {10.0}  # 1 + 2 + 3 + 4
    assert sorted(r["host"] for r in ranks) == ["node1", "node1", "node2", "node2"]


def test_slurm_conf_has_the_settings_the_lab_needs(tmp_path: Path) -> None:
    plugstack = tmp_path / "plugstack.conf"
    plugstack.write_text("required /x/spank_pyxis.so\n")
    state = default_state_dir("conf")
    conf = render_slurm_conf(ClusterSpec(state_dir=state, nodes=3, plugstack=plugstack))
    for line in ("SlurmUser=root", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
                 "SelectType=select/cons_tres", "ClusterName=slipway", "SlurmctldPort=6917",
                 f"AuthInfo=socket={state}/munge/munge.socket", "SlurmctldHost=slipway-ctl(10.213.0.1)",
                 "NodeName=node3 NodeHostname=node3 NodeAddr=10.213.0.13 CPUs=4", f"PlugStackConfig={plugstack}"):
        assert line in conf
    settings = [line.split("=")[0] for line in conf.splitlines() if not line.startswith("#")]
    assert "AccountingStorageType" not in settings and "JobCompType" not in settings


def test_hosts_block_is_replaced_and_removed_leaving_other_lines(tmp_path: Path, monkeypatch) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n10.0.0.5 db  # keep me\n")
    monkeypatch.setattr(cluster_host, "HOSTS", hosts)
    monkeypatch.setattr(cluster_host, "RUN_DIR", tmp_path / "run")
    cluster_host.set_hosts_block("t1", ["10.9.9.1\tctl", "10.9.9.11\tn1"])
    cluster_host.set_hosts_block("t1", ["10.9.9.1\tctl"])  # replaced, not appended twice
    text = hosts.read_text()
    assert text.count("10.9.9.1\tctl") == 1 and "n1" not in text and cluster_host.hosts_block_present("t1")
    cluster_host.set_hosts_block("t1", [])
    assert hosts.read_text() == "127.0.0.1 localhost\n10.0.0.5 db  # keep me\n"


@pytest.mark.parametrize("bad, words", [
    ({"name": "Too-Long-Name"}, "interface names"),
    ({"subnet": "10.213"}, "first three octets"),
    ({"nodes": 0}, "1 to 200"),
    ({"state_dir": Path("/tmp/has space")}, "slurm.conf cannot"),
    ({"state_dir": Path("/tmp/" + "d" * 75)}, "step sockets"),
])
def test_spec_rejects_what_would_break_later(tmp_path: Path, bad: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        ClusterSpec(**{"state_dir": tmp_path, **bad})


def test_up_cleans_a_crashed_cluster_and_down_leaves_nothing() -> None:
    # Short state dirs: slurmstepd's step sockets live under them (108 bytes at most).
    a, b = default_state_dir("t-a"), default_state_dir("t-b")
    # A cluster of its own (other name, names, subnet and ports), so the session's keeps running.
    spec = ClusterSpec(state_dir=a, nodes=2, name="slpwt", node_prefix="slpwt-node",
                       ctl_host="slpwt-ctl", subnet="10.213.1", ctld_port=6927, slurmd_port=6928)
    first = LocalSlurmCluster(spec).up()
    first_pids = cluster_pids(first)
    assert len(first_pids) == 4 and all(alive(p, s) for p, s in first_pids)
    # The first owner "crashes" (never calls down); a new up must clear what it left.
    second = LocalSlurmCluster(dataclasses.replace(spec, state_dir=b))
    try:
        second.up()
        assert not any(alive(p, s) for p, s in first_pids)
        assert second.node_states() == {"slpwt-node1": "idle", "slpwt-node2": "idle"}
        assert read_registry("slpwt")["state_dir"] == str(b)
        second_pids = cluster_pids(second)
    finally:
        second.down()
    assert not any(alive(p, s) for p, s in first_pids + second_pids)
    assert leftovers("slpwt", a) == [] and leftovers("slpwt", b) == []
    assert "slpwt" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "slpwt" not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert "slpwt" not in Path("/etc/hosts").read_text()
