"""Cluster profiles, remembered bad nodes and the measured warning lead on the real local Slurm
(the session's 2-node cluster, partition debug):

- a node blamed by one job's preflight is excluded from the next job of the same cluster, not
  from another cluster's; the record expires and is forgotten on request; a job the partition
  cannot run without it keeps it, and its clean preflight there clears it;
- a checkpoint directory held to 200 KiB/s grows the warning lead past Slurm's fixed tenth of the
  limit, the time-limit save completes before the kill, the requeued job takes its lead from that
  save; an `scontrol requeue` of the running job is counted as one preemption.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from common.events import parse_event
from common.rundir import PREFLIGHT_EXIT, SaveLine
from jobs.devcluster import unavailable_reason
from test_e2e import TINY, job_state, slipway, wait_for, wait_job_end
from slurm_fixtures import MAX_ARRAY_SIZE

pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]

PROFILES = """\
one:
  slurm: {time: "00:05:00"}
two:
  slurm: {partition: debug, time: "00:06:00"}
"""


def log_text(run_dir: Path) -> str:
    path = run_dir / "events.log"
    return path.read_text() if path.exists() else ""


def events(run_dir: Path) -> list[str]:
    return [line.split(" ", 3)[3] for line in log_text(run_dir).splitlines()]


def submit(*args: str) -> tuple[str, subprocess.CompletedProcess]:
    r = slipway("submit", "tiny_cpu", "--parsable", *args)
    assert r.returncode == 0, (r.stdout, r.stderr)
    return r.stdout.strip(), r


def excluded(job_id: str) -> str:
    info = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return re.search(r"ExcNodeList=(\S+)", info).group(1)


def cancel(job_id: str) -> None:
    subprocess.run(["scancel", job_id], check=False)
    wait_job_end(job_id, 120)


@pytest.fixture
def profiled(project, slurm_env, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("SLIPWAY_CLUSTER", raising=False)
    (project / "clusters.yaml").write_text(PROFILES)
    return project


def test_a_blamed_node_is_left_out_of_its_clusters_next_jobs_only(profiled, tmp_path):
    project = profiled
    # The interpreter the jobs run: this one, except that node2's preflight fails while MARK exists.
    mark, fake = tmp_path / "node2-broken", tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/bash\nif [ \"${{SLURMD_NODENAME:-}}\" = node2 ] && [ -e {shlex.quote(str(mark))} ] && "
                    "[[ \" $* \" == *\" trainer.preflight node \"* ]]; then\n"
                    "  echo 'slipway-preflight node2 fail: the test broke this node'; exit 5\nfi\n"
                    f"exec {shlex.quote(sys.executable)} \"$@\"\n")
    fake.chmod(0o755)
    mark.touch()
    common = [*TINY, "train.steps=2", f"launch.python={fake}"]
    two_nodes = ["--nodes", "2", "--dp", "4"]

    first, _ = submit("--cluster", "one", "--run-name", "blamed", *two_nodes, *common)
    assert wait_job_end(first, 240) == "FAILED"
    log = events(project / "runs" / "blamed")
    assert "bad nodes remembered for cluster one: node2 (its later jobs exclude them)" in log, log
    assert log[-1] == f"end exit {PREFLIGHT_EXIT}"  # no third node to retry on
    record = project / "runs" / ".nodes" / "one" / "node2"
    listed = slipway("nodes", "--cluster", "one")
    assert listed.stdout.startswith("node2: preflight since ") and "run blamed job " + first in listed.stdout
    assert listed.stdout.rstrip().endswith("preflight failed: the test broke this node"), listed.stdout

    # The same cluster's next job keeps away from node2; another cluster's does not.
    second, said = submit("--cluster", "one", "--run-name", "after", *common)
    assert excluded(second) == "node2", said.stderr
    assert "excluding the bad nodes cluster one remembers: node2 (preflight, since" in said.stderr
    cancel(second)
    third, said = submit("--cluster", "two", "--run-name", "elsewhere", *common)
    assert excluded(third) == "(null)" and "excluding" not in said.stderr
    cancel(third)
    manifest = json.loads((project / "runs" / "elsewhere" / "manifest.json").read_text())
    assert manifest["submissions"][-1]["cluster"]["name"] == "two"
    assert manifest["submissions"][-1]["cluster"]["settings"] == {"slurm": {"partition": "debug", "time": "00:06:00"}}

    def dry_run_excludes() -> bool:
        r = slipway("submit", "tiny_cpu", "--cluster", "one", "--run-name", "dry", *common, "--dry-run")
        assert r.returncode == 0, r.stderr
        return "#SBATCH --exclude=node2" in r.stdout

    assert dry_run_excludes()
    # Expired (the profile's forget_bad_nodes_after), and forgotten: used again.
    (project / "clusters.yaml").write_text(PROFILES.replace('one:\n', 'one:\n  cluster: {forget_bad_nodes_after: 1}\n'))
    time.sleep(1.5)
    assert not dry_run_excludes()
    (project / "clusters.yaml").write_text(PROFILES)
    kept = record.read_text()
    assert slipway("nodes", "--cluster", "one", "--forget", "node2").stdout == "forgot node2 (cluster one)\n"
    assert not dry_run_excludes()
    record.write_text(kept)

    # A 2-node job on a 2-node partition cannot do without node2: it runs there, and node2, healthy
    # again, passes its preflight, which clears the record.
    mark.unlink()
    fourth, said = submit("--cluster", "one", "--run-name", "cleared", *two_nodes, *common)
    assert ("not excluding node2 (preflight, since" in said.stderr and "remembered as bad by cluster one: the job "
            "needs 2 node(s) and partition debug has 2 usable, node2 included" in said.stderr), said.stderr
    assert wait_job_end(fourth, 300) == "COMPLETED"
    log = events(project / "runs" / "cleared")
    assert any(e.startswith("bad node node2 cleared for cluster one: a clean preflight (remembered since ") for e in log)
    assert not record.exists() and slipway("nodes", "--cluster", "one").stdout == "cluster one remembers no bad node\n"


def restart(job_id: str, run_dir: Path, attempt: int) -> None:
    """Let the requeued job start at once (a requeued job waits out the credential lifetime), and
    wait for its attempt `attempt` to start."""
    wait_for(lambda: job_state(job_id) == "PENDING", 120, "the job to be pending again")
    time.sleep(3)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True, capture_output=True)
    wait_for(lambda: f"(restart {attempt})" in log_text(run_dir), 120, f"attempt {attempt}")


def test_a_slow_checkpoint_directory_grows_the_lead_and_the_save_beats_the_kill(project, slurm_env, tmp_path):
    from slow_fs import SlowDirectory

    run_dir = project / "runs" / "slowsave"
    with SlowDirectory(tmp_path / "backing", tmp_path / "slow", bytes_per_second=200 << 10):
        job_id, _ = submit("--run-name", "slowsave", *TINY, "train.steps=1000000", "checkpoint.interval=1000000",
                           "logging.interval=10", "--time", "2", f"checkpoint.dir={tmp_path / 'slow' / 'ckpt'}")
        wait_for(lambda: job_state(job_id) == "RUNNING", 120, "the job to run")
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True, text=True).stdout
        end = datetime.strptime(out.strip(), "%Y-%m-%dT%H:%M:%S").astimezone()
        wait_for(lambda: "time-limit requeue 1/" in log_text(run_dir), 240, "the requeue")
        lines = [parse_event(line) for line in (run_dir / "events.log").read_text().splitlines()]
        said = [e.text for e in lines]
        lead = next(e for e in said if e.startswith("warning lead "))
        seconds = int(lead.split()[2])
        # Slurm's fixed warning would come a tenth of the 2 minutes (12 s) before the end; the checkpoint
        # of about 4 MiB at the 200 KiB/s the preflight measured takes about 20 s.
        assert seconds > 30 and "no save yet: about 4 MiB at the " in lead, lead
        warned = next(e.when for e in lines if e.text == "time limit warning: stop requested")
        assert (end - warned).total_seconds() >= seconds - 5, (end, warned, seconds)
        requeue = next(e for e in lines if e.text.startswith("time-limit requeue 1/"))
        assert "saved after the stop request (checkpoint at step" in requeue.text, said
        assert requeue.when < end and "TIMEOUT" not in said  # saved, requeued, before the kill
        save = SaveLine.parse((run_dir / "saves.log").read_text().splitlines()[-1])
        assert save.ms >= 10_000 and save.bytes > 3 << 20, save

        # The requeued job's lead comes from that save; an `scontrol requeue` of it is a preemption.
        restart(job_id, run_dir, 1)
        wait_for(lambda: sum(e.startswith("warning lead ") for e in events(run_dir)) >= 2, 120, "the new lead")
        lead = [e for e in events(run_dir) if e.startswith("warning lead ")][-1]
        assert f"the slowest of the run's last 1 save(s) took {(save.ms + 999) // 1000} s" in lead, lead
        subprocess.run(["scontrol", "requeue", job_id], check=True, capture_output=True)
        restart(job_id, run_dir, 2)
        cancel(job_id)
    log = events(run_dir)
    assert [e for e in log if e.startswith("preempted:")] == [
        "preempted: requeued by Slurm (a preemption, or scontrol requeue) in its previous attempt; preemption 1, "
        "counted apart from failure retries and time-limit requeues"], log
    assert "start on node1 (restart 2), failure retries 0/2, time-limit requeues 1/20, preemptions 1" in \
        [re.sub(r"start on \S+", "start on node1", e) for e in log], log
    status = slipway("status", "slowsave").stdout.replace("\n", " ")
    assert f"job {job_id}: 3 attempt(s); failure retries 0/2; time-limit requeues 1/20; preemptions 1" in status, status
    assert "time-limit warning lead " in status and "the slowest of the run's last 1 save(s)" in status, status


def test_doctor_checks_a_profile_against_the_live_cluster(profiled):
    project = profiled
    (project / "clusters.yaml").write_text(PROFILES + "gpus:\n  slurm: {partition: debug, gpus_per_node: 4}\n"
                                           "wrong:\n  slurm: {partition: nope}\n  cluster: {edf_dir: /proc/edf}\n")
    lines = {line.split(":", 1)[0]: line for line in slipway("doctor", "--cluster", "two").stdout.splitlines()}
    assert lines["ok   partition"].endswith("debug: 2 node(s)"), lines
    size = MAX_ARRAY_SIZE  # the session cluster's (tests/slurm_fixtures.py), read from Slurm by doctor
    assert lines["ok   MaxArraySize"] == f"ok   MaxArraySize: {size}: a sweep of up to {size - 1} points runs as one " \
                                          "array", lines
    assert "this cluster runs no accounting" in lines["ok   account and QoS"]
    r = slipway("doctor", "--cluster", "gpus")
    assert r.returncode == 1 and ("fail GPUs per node: no node of debug carries 4 GPUs (sinfo's gres: (null)): set "
                                  "slurm.partition to a GPU partition or lower slurm.gpus_per_node in ") in r.stdout
    r = slipway("doctor", "--cluster", "wrong")
    assert "fail partition: slurm.partition nope is not a partition of this cluster (it has debug): fix it in " \
        in r.stdout, r.stdout
    assert "fail EDF directory: /proc/edf is not writable here" in r.stdout, r.stdout
