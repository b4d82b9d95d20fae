"""Hangs, bad nodes and bounded retries on a real local Slurm cluster (CPU, gloo):

- a rank frozen with SIGSTOP mid-run: the job ends within train.hang_timeout and a stated
  bound, the other ranks' stacks are in runs/RUN/hangs/, events.log and `slipway status` say
  it hung and where, and a resubmission resumes from the last checkpoint (the session's
  2-node cluster: no spare node, so the job ends rather than retrying);
- on a 3-node cluster of its own, a 2-node job one of whose nodes cannot see the run
  directory: the preflight names it, the job is requeued without it and completes on the
  other two, events.log and `slipway status` say why;
- a job that fails its preflight the same way on every node stops after slurm.max_retries.

The 3-node cluster lowers the credential lifetime (cred_expire 10 s): a requeued job may not
start again before it has passed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from jobs.devcluster import ClusterSpec, LocalSlurmCluster, default_state_dir, read_registry, unavailable_reason
from slurm_fixtures import job_info
from test_e2e import (TINY, complete_checkpoints, job_state, resubmit_resumes, slipway, steps_logged, wait_for,
                      wait_job_end)
from common.rundir import HANG_EXIT, PREFLIGHT_EXIT, HangLine
from trainer.watchdog import HARD_EXIT_SECONDS, py_spy

pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]

HANG_TIMEOUT = 15
# Job end after the last completed step: the watchdog notices at hang_timeout, every rank has
# exited HARD_EXIT_SECONDS later at the latest (10 s in practice: its dump window), then
# torchrun and srun tear the step down (KillWait 5 s here) and the batch script decides.
END_BOUND = HARD_EXIT_SECONDS + 15


def submit(*args: str) -> str:
    r = slipway("submit", "tiny_cpu", "--parsable", *args)
    assert r.returncode == 0, (r.stdout, r.stderr)
    return r.stdout.strip()


def events(run_dir: Path) -> list[str]:
    """events.log without the time stamps."""
    return [line.split(" ", 1)[1] for line in (run_dir / "events.log").read_text().splitlines()]


def freeze_worker(run_name: str, node: str) -> tuple[int, str]:
    """SIGSTOP the trainer worker of LOCAL_RANK 1 on `node` (its environment says where it runs);
    returns (pid, its global rank)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                       if b"=" in kv)
        except OSError:
            continue
        if (b"trainer" in argv and b"torch.distributed.run" not in argv and Path(argv[0].decode()).name.startswith("python")
                and f"runs/{run_name}/config.yaml".encode() in b" ".join(argv)
                and env.get(b"SLURMD_NODENAME") == node.encode() and env.get(b"LOCAL_RANK") == b"1"):
            os.kill(int(pid), signal.SIGSTOP)
            return int(pid), env[b"RANK"].decode()
    pytest.fail(f"no trainer worker of {run_name} with LOCAL_RANK 1 on {node}")


# ------------------------------------------------------------------ 1. a frozen rank


def test_a_frozen_rank_ends_the_job_with_stack_dumps_and_a_resubmission_resumes(project, slurm_env):
    # The first checkpoint at step 20, the next at 40: the rank is frozen in training, not in a
    # save, whose collectives train.checkpoint_timeout bounds instead (with a save every 4 steps
    # the freeze once landed in one, and the job waited past this test's 10 minutes).
    args = ["--run-name", "frozen", "--nodes", "2", "--dp", "4", *TINY, "train.steps=400", "checkpoint.interval=20",
            f"train.hang_timeout={HANG_TIMEOUT}", "train.hang_timeout_first_step=120"]
    run_dir = project / "runs" / "frozen"
    job_id = submit(*args)
    # A few steps past it, which the resubmission repeats (resubmit_resumes finds the restart by them).
    wait_for(lambda: complete_checkpoints(run_dir) and len(steps_logged(run_dir)) >= 24, 150,
             "the first checkpoint and four steps after it")
    pid, rank = freeze_worker("frozen", "node2")
    frozen_at = time.time()
    try:
        # Without the watchdog the job would wait for its time limit: any end at all is its doing
        # (the hang event below says so). How soon is the product's bound, which a loaded machine
        # may stretch: printed, not asserted.
        state = wait_job_end(job_id, 600)
        took = time.time() - frozen_at
    finally:
        if Path(f"/proc/{pid}").exists():  # the job's end kills it; never leave it stopped
            os.kill(pid, signal.SIGKILL)
    print(f"frozen rank -> job end: {took:.1f} s (bound on an idle machine: {HANG_TIMEOUT + END_BOUND} s)")
    info = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    assert state == "FAILED" and f"ExitCode={HANG_EXIT}:0" in info, info

    # Every rank that was running wrote its stacks in time; the frozen one at most late.
    dumps = {p.name: p.read_text() for p in (run_dir / "hangs").glob(f"{job_id}-*.txt")}
    frozen = f"{job_id}-node2-{rank}.txt"
    on_time = {name for name, text in dumps.items() if HangLine.parse(text.splitlines()[0]).on_time}
    assert len(on_time) == 3 and frozen not in on_time, {n: t.splitlines()[0] for n, t in dumps.items()}
    assert frozen not in dumps or not HangLine.parse(dumps[frozen].splitlines()[0]).on_time
    for name in on_time:
        text = dumps[name]
        assert "Python stacks of every thread" in text and 'File "' in text, text[:2000]
        assert "flight recorder: " in text and "gloo:" in text, text[:2000]
        if py_spy():  # CI installs py-spy (.ci/run): its dump must be there too
            assert "py-spy dump:\nProcess " in text, text[-2000:]
    log = events(run_dir)
    hang = [e for e in log if e.startswith(f"job {job_id} hang: ")]
    assert len(hang) == 1 and f"no step completed for {HANG_TIMEOUT} s" in hang[0], log
    assert hang[0].endswith("not answering in time: 1 of the 2 ranks on node2"), hang[0]
    assert (f"job {job_id} not retrying (hang): without node2 partition debug has 1 usable node(s), the job needs 2"
            in log), log
    assert log[-1] == f"job {job_id} end exit {HANG_EXIT}"

    status = slipway("status", "frozen")
    # Slurm says FAILED; the run's own state says what happened (jobs/runs/lifecycle.py)
    assert status.returncode == 0 and "HUNG" in status.stdout and "FAILED" not in status.stdout, status.stdout
    assert f"hung (attempt 1 of job {job_id})" in status.stdout and "not answering in time: 1 of the 2 ranks on node2" in status.stdout
    assert f"rank {rank} on node2:" in status.stdout or f"hangs/{job_id}-node1-" in status.stdout

    resubmit_resumes(run_dir, args, complete_checkpoints(run_dir)[-1], 400)


# ------------------------------------------------------------------ 2. a bad node among three


@pytest.fixture(scope="module")
def three_nodes():
    """A 3-node cluster of its own (names, subnet and ports apart from the session's), each
    slurmd in a mount namespace of its own (node_private) so that one node's view of a
    directory can differ, and requeued jobs held for 10 s rather than 120."""
    state = default_state_dir("hang")
    spec = ClusterSpec(state_dir=state, nodes=3, name="slpwh", node_prefix="slpwh-node", ctl_host="slpwh-ctl",
                       subnet="10.213.4", ctld_port=6937, slurmd_port=6938, cred_expire=10,
                       node_private=(str(state / "private"),))
    cluster = LocalSlurmCluster(spec).up()
    try:
        yield cluster
    finally:
        cluster.down()


def on_node(cluster: LocalSlurmCluster, node: str, *argv: str) -> None:
    """Run `argv` in `node`'s mount namespace (that of its slurmd, which its jobs inherit)."""
    pid = next(p["pid"] for p in read_registry(cluster.spec.name)["processes"] if p["role"] == f"slurmd {node}")
    subprocess.run(["nsenter", "-t", str(pid), "-m", *argv], check=True, capture_output=True, text=True)


@pytest.fixture
def three_env(three_nodes, monkeypatch):
    for key, value in three_nodes.env().items():
        monkeypatch.setenv(key, value)
    return three_nodes


def test_a_node_failing_its_preflight_is_left_out_and_the_job_completes(project, three_env):
    cluster = three_env
    runs = project / "runs"
    runs.mkdir()
    # On node 2 alone the runs directory is an empty tmpfs: the run directory is not there.
    on_node(cluster, "slpwh-node2", "mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(runs))
    try:
        job_id = submit("--run-name", "badnode", "--nodes", "2", "--dp", "4", *TINY, "train.steps=6")
        assert wait_job_end(job_id, 300) == "COMPLETED", (runs / "badnode" / "events.log").read_text()
    finally:
        on_node(cluster, "slpwh-node2", "umount", str(runs))
    run_dir = runs / "badnode"
    log = events(run_dir)
    assert log[0] == f"job {job_id} start on slpwh-node[1-2] (restart 0), failure retries 0/2, time-limit requeues 0/20"
    # The first check a node makes, what it runs against what was submitted, finds nothing there.
    code = json.loads((run_dir / "manifest.json").read_text())["code"]["dir"]
    assert (f"job {job_id} preflight failed on slpwh-node2: the code snapshot {code} is not there (removed after "
            "submission, or this node does not see its filesystem)") in log, log
    assert f"job {job_id} retry 1/2 (preflight): requeueing without slpwh-node2 (excluded nodes: slpwh-node2)" in log
    assert (f"job {job_id} start on slpwh-node[1,3] (restart 1), failure retries 1/2, time-limit requeues 0/20"
            in log), log
    assert any(e.startswith(f"job {job_id} preflight ok on slpwh-node[1,3]: all-reduce of 4 MiB over 4 ranks on 2 "
                            "node(s) (gloo): ") and "GB/s bus bandwidth" in e for e in log), log
    assert log[-1] == f"job {job_id} end exit 0"
    assert steps_logged(run_dir)[-1] == 6
    info = job_info(cluster, job_id)
    assert info["ExcNodeList"] == "slpwh-node2" and info["NodeList"] == "slpwh-node[1,3]"

    status = slipway("status", "badnode")
    assert status.returncode == 0 and "COMPLETED" in status.stdout, status.stdout
    assert (f"job {job_id}: 2 attempt(s); failure retries 1/2 (preflight); time-limit requeues 0/20; preemptions 0; "
            "excluded nodes slpwh-node2") in status.stdout.replace("\n", " "), status.stdout
    assert "last failure: preflight failed on slpwh-node2: the code snapshot" in status.stdout


def test_a_job_that_fails_alike_everywhere_stops_after_max_retries(project, three_env):
    cluster = three_env
    small = project / "small-disk"
    small.mkdir()
    nodes = cluster.spec.node_names
    for node in nodes:  # a 1 MiB filesystem where checkpoints go, on every node
        on_node(cluster, node, "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small))
    try:
        job_id = submit("--run-name", "nospace", "--nodes", "2", "--dp", "4", *TINY, "train.steps=6",
                        f"checkpoint.dir={small / 'ckpt'}")
        assert wait_job_end(job_id, 240) == "FAILED"
    finally:
        for node in nodes:
            on_node(cluster, node, "umount", str(small))
    log = events(project / "runs" / "nospace")
    failed = [e for e in log if e.startswith(f"job {job_id} preflight failed on ")]
    assert len(failed) == 6 and all(re.search(r" [0-9.]+ (B|[KMGT]iB) free at ", e) and "one checkpoint needs about 3.8 MiB" in e for e in failed), log
    assert [e for e in log if " retry " in e or "retrying" in e] == [
        f"job {job_id} retry 1/2 (preflight): requeueing (no node to blame)",
        f"job {job_id} retry 2/2 (preflight): requeueing (no node to blame)",
        f"job {job_id} not retrying (preflight): slurm.max_retries (2) reached"], log
    assert log[-1] == f"job {job_id} end exit {PREFLIGHT_EXIT}"
    assert f"ExitCode={PREFLIGHT_EXIT}:0" in subprocess.run(["scontrol", "show", "job", "-o", job_id],
                                                             capture_output=True, text=True).stdout
    assert not (project / "runs" / "nospace" / "metrics.jsonl").exists()  # it never trained
    status = slipway("status", "nospace")
    assert "failure retries 2/2 (preflight, preflight)" in status.stdout.replace("\n", " ")
    assert "last failure: not retrying (preflight): slurm.max_retries (2) reached" in status.stdout
    assert json.loads((project / "runs" / "nospace" / "manifest.json").read_text())["submissions"][0]["job_id"] == job_id
    assert job_state(job_id) == "FAILED"
