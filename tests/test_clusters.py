"""Cluster profiles (jobs/config/clusters.py) and a cluster's remembered bad nodes (jobs/slurm/bad_nodes.py),
through the command line, without Slurm: one config rendered for two clusters, the precedence
config < profile < command line, an unknown cluster, hostile profile files (damaged, huge, a
FIFO, a secret, a key that does not exist), and `slipway nodes` (why, since when, expiry,
--forget, damaged records). On the real local Slurm: tests/test_clusters_slurm.py."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from jobs.slurm.bad_nodes import BadNode

PROFILES = """\
alps:
  slurm: {account: a-g34, partition: normal, time: "00:20:00", extra: [--exclusive]}
  container: {runtime: edf, image: /capstor/images/ngc.sqsh, mounts: [/capstor/scratch]}
uni:
  slurm: {partition: gpu, qos: short}
  container: {runtime: pyxis, image: nvcr.io#nvidia/pytorch:25.12-py3}
  cluster: {forget_bad_nodes_after: 60}
"""


def slipway(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def profiles(project: Path, tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))  # the user's own file: none, unless a test writes it
    monkeypatch.delenv("SLIPWAY_CLUSTER", raising=False)
    (project / "clusters.yaml").write_text(PROFILES)
    return project / "clusters.yaml"


def script_of(out: str) -> str:
    return out.split("job.sbatch <==\n", 1)[1]


def sbatch_lines(out: str) -> list[str]:
    return [line for line in script_of(out).splitlines() if line.startswith("#SBATCH")]


def test_one_config_renders_for_two_clusters_and_the_command_line_wins(profiles):
    alps = slipway("submit", "tiny_cpu", "--cluster", "alps", "--dry-run")
    uni = slipway("submit", "tiny_cpu", "--dry-run", env={"SLIPWAY_CLUSTER": "uni"})
    # alps is refused here (its image and mounts are not on this machine): rendered all the same.
    assert alps.returncode == 2 and uni.returncode == 0 and not alps.stderr + uni.stderr, (alps.stderr, uni.stderr)
    a, u = sbatch_lines(alps.stdout), sbatch_lines(uni.stdout)
    # The profile wins over the config (tiny_cpu says runtime none, 00:30:00).
    assert {"#SBATCH --account=a-g34", "#SBATCH --partition=normal", "#SBATCH --time=00:20:00",
            "#SBATCH --exclusive"} <= set(a), a
    assert {"#SBATCH --partition=gpu", "#SBATCH --qos=short", "#SBATCH --time=00:30:00"} <= set(u), u
    assert "--environment=" in script_of(alps.stdout) and "--container-image=" not in script_of(alps.stdout)
    assert "--container-image=nvcr.io#nvidia/pytorch:25.12-py3" in script_of(uni.stdout)
    assert "runtime edf" in alps.stdout and "cluster alps" in alps.stdout and "cluster uni" in uni.stdout
    assert "CLUSTER=alps" in script_of(alps.stdout) and "CLUSTER=uni" in script_of(uni.stdout)
    # The command line wins over the profile, the flag and an override alike.
    cli = slipway("submit", "tiny_cpu", "--cluster", "alps", "--time", "00:10:00", "slurm.partition=debug",
                  "--dry-run")
    assert {"#SBATCH --time=00:10:00", "#SBATCH --partition=debug"} <= set(sbatch_lines(cli.stdout)), cli.stdout


def test_the_users_profile_merges_under_the_projects(profiles, tmp_path):
    user = tmp_path / "xdg" / "slipway" / "clusters.yaml"
    user.parent.mkdir(parents=True)
    user.write_text("alps:\n  slurm: {account: mine, qos: debug}\nlaptop:\n  container: {runtime: none}\n")
    r = slipway("submit", "tiny_cpu", "--cluster", "alps", "--dry-run")
    lines = set(sbatch_lines(r.stdout))
    assert {"#SBATCH --account=a-g34", "#SBATCH --qos=debug", "#SBATCH --partition=normal"} <= lines, lines
    unknown = slipway("submit", "tiny_cpu", "--cluster", "daint", "--dry-run")
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert unknown.stderr == (f"slipway: error: --cluster: no cluster 'daint' in {user} or {profiles}; known "
                              "clusters: alps, laptop, uni\n")


@pytest.mark.parametrize("text, field, says", [
    ("alps:\n  slurm: {partition: [a\n", "clusters.yaml line", "not valid YAML"),
    ("- alps\n", "clusters.yaml", "must map cluster names to profiles"),
    ("alps: 3\n", "clusters.yaml alps", "expected a profile"),
    ("'a b':\n  slurm: {}\n", "clusters.yaml 'a b'", "is not a cluster name"),
    ("alps:\n  slurm: {partiton: x}\n", "clusters.yaml alps.slurm.partiton",
     "unknown key; did you mean alps.slurm.partition or alps.slurm.prepare_partition? valid keys of alps.slurm are: "
     "nodes, gpus_per_node"),
    ("alps:\n  model: {hidden_size: 64}\n", "clusters.yaml alps.model",
     "unknown key; valid keys of a cluster profile are: slurm, container, launch, image, cluster"),
    ("alps:\n  slurm: {nodes: many}\n", "clusters.yaml alps.slurm.nodes", "expected an integer"),
    ("alps:\n  launch:\n    env: {HF_TOKEN: hf_abcdefghijklmnopqrstuvwxyzABCDEFGH}\n", "clusters.yaml alps.launch.env.HF_TOKEN",
     "secret"),
    ("alps:\n  cluster: {forget_bad_nodes_after: -1}\n", "alps.cluster.forget_bad_nodes_after", "must be between 0"),
    ("alps:\n  slurm: {signal_seconds: 2000, time: '00:30:00'}\n", "slurm.signal_seconds",
     "(set by cluster profile alps"),
])
def test_a_bad_profile_is_one_line_naming_the_file_and_key(profiles, text, field, says):
    profiles.write_text(text)
    r = slipway("submit", "tiny_cpu", "--cluster", "alps", "--dry-run")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, (r.stdout, r.stderr)
    assert field in r.stderr and says in r.stderr, r.stderr
    assert "hf_abcdefghij" not in r.stderr


def test_hostile_profile_files(profiles):
    profiles.write_text("x" * 2_000_000)
    r = slipway("doctor", "--cluster", "alps")
    assert r.returncode == 2 and "larger than 1000000 bytes" in r.stderr and r.stderr.count("\n") == 1
    profiles.unlink()
    os.mkfifo(profiles)  # never opened: it would block
    r = slipway("submit", "tiny_cpu", "--cluster", "alps", "--dry-run")
    assert r.returncode == 2 and "is a FIFO, not a regular file" in r.stderr, r.stderr
    r = slipway("submit", "tiny_cpu", "--dry-run", env={"SLIPWAY_CLUSTER": "../x"})
    assert r.returncode == 2 and r.stderr.startswith("slipway: error: $SLIPWAY_CLUSTER: '../x' is not a cluster name")
    profiles.unlink()
    r = slipway("submit", "tiny_cpu", "--cluster", "alps", "--dry-run")
    assert r.returncode == 2 and "no profile is written yet: add one to" in r.stderr


def _record(directory: Path, node: str, hours_ago: float, kind: str = "hang") -> BadNode:
    when = (datetime.now(timezone.utc) - timedelta(hours=hours_ago)).isoformat(timespec="seconds")
    record = BadNode(node, when, when, "r1", "41", kind, f"{kind}: on {node}")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / node).write_text(record.line() + "\n")
    return record


@pytest.mark.slow
def test_nodes_lists_why_and_since_when_expires_and_forgets(profiles, project):
    alps = project / "runs" / ".nodes" / "alps"
    _record(alps, "nid001", 2)
    _record(alps, "nid002", 30)  # older than a day: expired
    _record(project / "runs" / ".nodes" / "uni", "nid003", 0.5)
    (alps / "nid004").write_text("half a rec")  # damaged: named, never trusted
    os.mkfifo(alps / "nid005")
    r = slipway("nodes", "--cluster", "alps")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("nid001: hang since ") and lines[0].endswith("more): hang: on nid001"), lines
    assert "excluded for 21h" in lines[0] and not any("nid002" in l or "nid003" in l for l in lines)
    assert any(l.startswith("damaged: ") and "nid004: not a bad node's record" in l for l in lines), lines
    assert any("nid005: is a FIFO" in l for l in lines), lines
    # Another cluster's memory is its own; its profile's forget_bad_nodes_after (60 s) expires it.
    uni = slipway("nodes", "--cluster", "uni")
    assert uni.stdout == "cluster uni remembers no bad node (1 expired)\n", uni.stdout
    r = slipway("nodes", "--cluster", "alps", "--forget", "nid001", "--forget", "nid004")
    assert r.returncode == 0 and r.stdout == "forgot nid001 (cluster alps)\nforgot nid004 (cluster alps)\n"
    r = slipway("nodes", "--cluster", "alps", "--forget", "nid001")
    assert r.returncode == 2 and r.stderr == ("slipway: error: --forget: cluster alps remembers no node 'nid001' (it "
                                              "remembers: nid002)\n"), r.stderr
    r = slipway("nodes", "--cluster", "alps", "--forget", "../../etc")
    assert r.returncode == 2 and "is not a node name" in r.stderr
    assert slipway("nodes").stdout == "cluster default remembers no bad node\n"  # no profile: `default`
