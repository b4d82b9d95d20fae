"""pytest fixtures for the real local Slurm cluster of jobs/devcluster/ (`slipway cluster`).

tests/conftest.py makes them available to every test module:

    from slurm_fixtures import slurm_cluster, slurm_env  # noqa: F401

`slurm_cluster` (session): a 2-node cluster (node1, node2; partition `debug`,
the default; 4 CPUs each; MaxArraySize 4; state and logs in /tmp/slipway-slurm-UID-pytest),
started once and stopped by the ids it started at the end of the session (and
at interpreter exit if the session dies first). It takes over from any
cluster `slipway cluster up` started: one cluster per machine.
Client commands reach it with `slurm_cluster.env()` = {"SLURM_CONF": ...}.
`slurm_env` (function): the same, set in os.environ for one test.

Before each test (tests/conftest.py's pytest_runtest_setup, ahead of its fixtures,
module-scoped ones included) a slurmd that died is started again and its node
brought back, with a warning in the summary: the daemon itself is not under test,
and one crash (`restart_dead_nodes` says which) would otherwise
fail every later Slurm test of the session.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
import warnings
from pathlib import Path
from typing import Iterator

import pytest

from jobs.devcluster import (ClusterSpec, LocalSlurmCluster, default_state_dir, read_registry,  # noqa: E402
                             unavailable_reason)

SLURM_NODES = 2
MAX_ARRAY_SIZE = 4  # small, so that a sweep of five points takes two arrays (tests/test_sweep.py)
# The clusters up now (the session's, the pyxis tier's), each with the PATH its daemons start with.
_RUNNING: list[tuple[LocalSlurmCluster, str]] = []


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[LocalSlurmCluster]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    # Not a pytest tmp dir: pytest deletes all but the 3 newest basetemps when a
    # session starts, so a concurrent pytest run could remove a live cluster's
    # conf and munge socket. This one is wiped at each start; its logs stay.
    cluster = LocalSlurmCluster(ClusterSpec(state_dir=default_state_dir("pytest"), nodes=SLURM_NODES,
                                            max_array_size=MAX_ARRAY_SIZE))
    atexit.register(cluster.down, check=False)
    cluster.up()
    try:
        with kept_up(cluster, os.environ["PATH"]):
            yield cluster
    finally:
        cluster.down()
        atexit.unregister(cluster.down)


@contextlib.contextmanager
def kept_up(cluster: LocalSlurmCluster, path: str) -> Iterator[None]:
    """While this lasts, a dead slurmd of `cluster` is started again before each test, ahead of its
    fixtures, with `path` as its PATH (the pyxis tier's puts its enroot first: pyxis runs the one
    its slurmd finds)."""
    entry = (cluster, path)
    _RUNNING.append(entry)
    try:
        yield
    finally:
        _RUNNING.remove(entry)


@pytest.fixture
def slurm_env(slurm_cluster: LocalSlurmCluster, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """SLURM_CONF in os.environ for this test, so plain `sbatch`/`squeue` reach the cluster."""
    env = slurm_cluster.env()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # The jobs run as from a user's shell, whose Python caches bytecode (beside a run's code snapshot too).
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    return env


def restart_dead_nodes(cluster: LocalSlurmCluster, timeout: float = 60) -> list[str]:
    """Start again each slurmd of `cluster` that exited, and return its node's name once the node
    is back in service. Debian's Slurm 22.05 slurmd has been seen to abort in glibc's heap check
    (`tcache_thread_shutdown(): unaligned tcache chunk detected`) right after two steps of one job
    launched on it at once; its node then stays DOWN for every later job."""
    names = [p["role"].split(" ", 1)[1] for p in cluster.status().get("processes", [])
             if p["role"].startswith("slurmd ") and not p["alive"]]
    for name in names:
        cluster.start_node(name)
    deadline = time.monotonic() + timeout
    while names:
        states = cluster.node_states()
        if all(states.get(n) in ("idle", "allocated", "mixed", "completing") for n in names):
            break
        assert time.monotonic() < deadline, f"restarted slurmd on {names}, but sinfo says {states}"
        time.sleep(0.5)
    return names


def restart_dead_session_nodes() -> None:
    """Bring back the nodes whose slurmd died, of every cluster kept up (see the module docstring)."""
    for cluster, path in list(_RUNNING):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PATH", path)
            names = restart_dead_nodes(cluster)
        if names:
            warnings.warn(f"slurmd of {', '.join(names)} had exited and was started again (its log: "
                          f"{cluster.spec.log_dir})", stacklevel=1)


def job_info(cluster: LocalSlurmCluster, job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, ExitCode, NodeList, StdOut, ...)."""
    out = cluster.run("scontrol", "show", "job", "-o", job_id).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def sbatch(cluster: LocalSlurmCluster, script: Path) -> str:
    """Submit `script` from its folder; return the job id."""
    return cluster.run("sbatch", "--parsable", str(script), cwd=script.parent).stdout.strip().split(";")[0]


def wait_job(cluster: LocalSlurmCluster, job_id: str, timeout: float = 120) -> dict[str, str]:
    """Wait until `job_id` has ended; return its last `job_info`. On timeout the job is cancelled
    and the failure says where it was stuck, with the daemons' logs."""
    deadline = time.monotonic() + timeout
    while True:
        info = job_info(cluster, job_id)
        if info.get("JobState") not in {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING",
                                        "REQUEUED", "RESIZING", "SUSPENDED"}:
            return info
        if time.monotonic() > deadline:
            cluster.run("scancel", job_id, check=False)
            raise AssertionError(f"job {job_id} still {info.get('JobState')} ({info.get('Reason')}) after "
                                 f"{timeout:.0f} s; cancelled. Its output: {info.get('StdOut')}\n{cluster.log_tails()}")
        time.sleep(0.25)


def cluster_pids(cluster: LocalSlurmCluster) -> list[tuple[int, int]]:
    """(pid, start time) of the daemons `cluster` started, from its registry."""
    return [(p["pid"], p["start"]) for p in (read_registry(cluster.spec.name) or {}).get("processes", [])]
