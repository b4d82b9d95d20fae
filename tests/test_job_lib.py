"""The job library (jobs/slurm/job_lib.sh and its pyxis part, pyxis_lib.sh) function by function, in
bash, with stand-in Slurm and enroot commands on PATH: the decisions it takes from prepared files
and the events it writes. No Slurm;
the whole batch script is run in tests/test_hang_script.py, and on a real cluster in
tests/test_hang_slurm.py."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from common.rundir import HangLine, RunDir
from jobs.slurm.bad_nodes import BadNode
from jobs.slurm.script import LIBRARIES

SETTINGS = """{paths}
NODES_NEEDED=2 PROCS_PER_NODE=2 RANKS=4 REQUEUE=1 MAX_RETRIES=2 MAX_REQUEUES=3 PREFLIGHT_TIMEOUT=300
NO_REQUEUE='slurm.requeue is off'
PREFLIGHT_EXIT=5 HANG_EXIT=4 REQUEUE_EXIT=75 BAD_INPUT_EXIT=2 CANCEL_EXIT=140 TERM_EXIT=143
CONTAINER_PREFIX={prefix} CONTAINER_BUILD={build} KEEP_BUILDS=2
STEP_STOP_WAIT=5 CONTAINER_REMOVE_WAIT=1 CANCEL_REMOVE_WAIT=3 STALE_REMOVE_TIMEOUT=60
JOB_TAG=41 NODES="node1 node2" RETRIES=0 REQUEUES=0 PREEMPTIONS=0 HELPER_PIDS=() SRUN_PID="" STOP_REQUESTED=0 TRAPPED=0
CLUSTER=alps BAD_NODES_DIR={nodes}
LEAD_AUTO=1 LEAD_MIN=60 LEAD_DEFAULT=300 LEAD_MAX=1800 WARNING_POLL=1 CHECKPOINT_BYTES=1073741824 SYNC_STEPS=10
"""


class Lib:
    """A run directory, stand-in commands in bin/ (each logs its call to calls.log), and bash
    running the library followed by a few lines."""

    def __init__(self, tmp_path: Path, prefix: str = "''", build: str = "''"):
        self.tmp = tmp_path
        self.run_dir = tmp_path / "run"
        (self.run_dir / "hangs").mkdir(parents=True)
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        self.prefix, self.build = prefix, build
        self.nodes = tmp_path / "runs" / ".nodes" / "alps"  # the cluster's remembered bad nodes
        for name in ("scontrol", "sinfo", "srun", "squeue", "enroot"):
            self.stand_in(name, "")

    def stand_in(self, name: str, body: str) -> None:
        path = self.bin / name
        path.write_text(f'#!/bin/bash\necho "{name} $*" >> "$CALLS"\n{body}\n')
        path.chmod(0o755)

    def script(self, body: str) -> str:
        paths = "\n".join(f"{name}={shlex.quote(str(path))}"  # where the batch script says the run's files are
                          for name, path in RunDir(self.run_dir).shell_paths("checkpoints").items())
        return ("set -euo pipefail\n" + SETTINGS.format(paths=paths, prefix=self.prefix, build=self.build,
                                                        nodes=shlex.quote(str(self.nodes)))
                + "".join(LIBRARIES.values()) + "\nCONTAINER_NAME=$(container_name)\n" + body + "\n")

    def env(self) -> dict[str, str]:
        return {"PATH": f"{self.bin}:{os.environ['PATH']}", "SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "node[1-2]",
                "CALLS": str(self.tmp / "calls.log"), "HOME": str(self.tmp)}

    def run(self, body: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", self.script(body)], env=self.env(), capture_output=True, text=True,
                              timeout=30)

    def events(self) -> list[str]:
        path = self.run_dir / "events.log"
        return [line.split(" ", 3)[3] for line in path.read_text().splitlines()] if path.exists() else []

    def calls(self) -> list[str]:
        path = self.tmp / "calls.log"
        return path.read_text().splitlines() if path.exists() else []


def test_event_lines_keep_their_format(tmp_path):
    lib = Lib(tmp_path)
    assert lib.run('event "start on node[1-2]"').returncode == 0
    line = (lib.run_dir / "events.log").read_text()
    when, job, job_id, text = line.rstrip("\n").split(" ", 3)
    assert (job, job_id, text) == ("job", "41", "start on node[1-2]") and when[4] == "-" and "T" in when


def test_a_node_name_from_the_job_side_never_forges_a_line_and_the_log_names_the_task_as_status_does(tmp_path):
    """A rank's report naming a node `n1\\n<TIME> job 41 end exit 0` (a hostname the job side gave)
    is no node's name: the step's failure names none, and no event text, whatever it holds, makes
    a second line. A sweep's task ends its log naming itself ARRAY_TASK, as status names it."""
    lib = Lib(tmp_path)
    reports = tmp_path / "exits"
    reports.mkdir()
    (reports / "rank-1").write_text("137 n1\x1b\n")
    r = lib.run(f'step_exit 1 "{reports}"; after_rank_failure "$STEP_EXIT"; '
                'event "hang on n2$(printf \'\\n2026-01-01T00:00:00+00:00 job 41 end exit 0\\r\')"')
    assert r.returncode == 0, r.stderr
    assert lib.events() == ["rank failed: rank 1 on ? was killed by SIGKILL (exit 137)",
                            "hang on n2 2026-01-01T00:00:00+00:00 job 41 end exit 0 "], lib.events()
    proc = subprocess.run(["bash", "-c", lib.script("trap on_exit EXIT; event 'start on node1'; exit 0")],
                          env={**lib.env(), "SLURM_JOB_ID": "3", "SLIPWAY_EVENT_JOB": "2_0"}, capture_output=True,
                          text=True, timeout=30)
    assert "slipway: job 2_0 ended: completed (exit 0)" in proc.stdout, (proc.stdout, proc.stderr)


def test_retries_and_requeues_are_counted_per_job(tmp_path):
    lib = Lib(tmp_path)
    (lib.run_dir / "events.log").write_text(
        "t job 41 retry 1/2 (hang): requeueing (no node to blame)\n"
        "t job 41 time-limit requeue 1/3: saved, requeueing\nt job 40 retry 1/2 (hang): another job's\n")
    r = lib.run('echo "$(count_events retry) $(count_events time-limit requeue)"; SLURM_RESTART_COUNT=2 job_tag')
    assert r.stdout.split() == ["1", "1", "41r2"], r.stderr


def test_a_rank_killed_by_a_signal_decides_the_steps_exit_whatever_srun_says(tmp_path):
    """srun said 143 or 1 depending on the node; the rank's own report says 137 (SIGKILL), and
    events.log names it, its node and the signal."""
    lib = Lib(tmp_path)
    reports = tmp_path / "exits"
    reports.mkdir()
    # oldest first: rank 3 finished, rank 2 killed, node1's torchrun agent exited 1 after it, rank 0 induced
    for name, code in (("rank-3", "0 node2"), ("rank-2", "137 node2"), ("task-0", "1 node1"), ("rank-0", "143 node1")):
        (reports / name).write_text(code + "\n")
        time.sleep(0.02)
    (reports / "preflight-failed").write_text("not a code\n")
    for srun_rc in ("1", "143"):
        r = lib.run(f'step_exit {srun_rc} "{reports}"; echo "$STEP_EXIT|$FAILED_WHO"; after_rank_failure "$STEP_EXIT"')
        assert r.stdout.strip() == "137|rank 2 on node2", r.stderr
    assert lib.events() == ["rank failed: rank 2 on node2 was killed by SIGKILL (exit 137)"] * 2
    assert lib.run(f'step_exit 0 "{reports}"; echo "$STEP_EXIT|$FAILED_WHO"').stdout.strip() == "0|"
    assert lib.run(f'step_exit 1 "{tmp_path / "none"}"; echo "$STEP_EXIT|$FAILED_WHO"').stdout.strip() == "1|"  # a node died
    # An agent's report alone, and a plain failure: named as such; the ends told otherwise are not.
    (reports / "rank-2").unlink()
    (reports / "rank-0").unlink()
    r = lib.run(f'step_exit 1 "{reports}"; after_rank_failure "$STEP_EXIT"; after_rank_failure 75; '
                'after_rank_failure 4; STOP_REQUESTED=1 after_rank_failure 1')
    assert lib.events()[2:] == ["rank failed: the torchrun agent of task 0 on node1 exited 1"], r.stderr


def test_the_task_wrapper_reports_what_killed_its_rank(tmp_path):
    """The wrapper jobs/slurm/ranks.py puts around each rank (and each torchrun agent): its report
    is what step_exit reads."""
    from jobs.slurm.ranks import REPORT_EXIT

    reports = tmp_path / "exits"
    reports.mkdir()
    env = {**os.environ, "SLIPWAY_EXITS": str(reports), "SLURM_PROCID": "5", "RANK": "7", "SLURMD_NODENAME": "nodeA"}
    r = subprocess.run(["bash", "-c", REPORT_EXIT, "slipway-rank", "bash", "-c", "kill -KILL $$"], env=env)
    assert r.returncode == 137 and (reports / "rank-7").read_text() == "137 nodeA\n"
    r = subprocess.run(["bash", "-c", REPORT_EXIT, "slipway-task", "bash", "-c", "exit 1"], env=env)
    assert r.returncode == 1 and (reports / "task-5").read_text() == "1 nodeA\n"


def test_a_plain_scancel_is_told_as_cancelled_with_exit_143(tmp_path):
    lib = Lib(tmp_path)
    proc = subprocess.Popen(["bash", "-c", lib.script('trap on_exit EXIT; trap on_term TERM\n'
                                                      'event started; sleep 20 & SRUN_PID=$!; wait "$SRUN_PID"')],
                            env=lib.env())
    _wait_for(lambda: "started" in lib.events())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 143
    assert lib.events() == ["started", "cancelled (SIGTERM)", "end exit 143"]


def test_slipway_cancel_is_told_and_removes_the_container_while_the_allocation_exists(tmp_path):
    lib = Lib(tmp_path, prefix="slipway-")
    proc = subprocess.Popen(["bash", "-c", lib.script('trap on_exit EXIT; trap on_cancel USR2\n'
                                                      'event started; sleep 20 & SRUN_PID=$!; wait "$SRUN_PID"')],
                            env=lib.env())
    _wait_for(lambda: "started" in lib.events())
    proc.send_signal(signal.SIGUSR2)
    assert proc.wait(timeout=15) == 140
    assert lib.events() == ["started", "cancelled by slipway cancel", "end exit 140"]
    calls = "\n".join(lib.calls())  # srun's arguments carry the functions' text, lines and all
    assert calls.count("srun ") == 1 and calls.endswith('; "$@" slipway-rm remove_named slipway-41'), calls


def test_the_end_is_written_before_a_slow_removal_which_never_delays_the_end(tmp_path):
    lib = Lib(tmp_path, prefix="slipway-")
    lib.stand_in("srun", 'echo "removal started" >> "$RUN_DIR_SEEN/events.log"; sleep 20; '
                         'echo "removal finished" >> "$RUN_DIR_SEEN/events.log"')
    proc = subprocess.run(["bash", "-c", lib.script("trap on_exit EXIT; exit 3")],
                          env={**lib.env(), "RUN_DIR_SEEN": str(lib.run_dir)}, timeout=60)
    lines = (lib.run_dir / "events.log").read_text().splitlines()
    # The job ended while the removal still ran (CONTAINER_REMOVE_WAIT=1 bounds the wait for it).
    assert proc.returncode == 3 and lines[0].endswith(" job 41 end exit 3") and lines[1:] == ["removal started"], lines


def test_no_container_no_removal(tmp_path):
    lib = Lib(tmp_path)
    assert lib.run("trap on_exit EXIT; remove_stale_containers; exit 0").returncode == 0
    assert not [c for c in lib.calls() if c.startswith("srun")] and lib.events() == ["end exit 0"]


def test_stale_containers_are_those_of_jobs_that_are_over(tmp_path):
    lib = Lib(tmp_path)
    lib.stand_in("enroot", "printf '%s\\n' pyxis_slipway-30 pyxis_slipway-31r2 pyxis_7_slipway-7 "
                           "pyxis_slipway-41 pyxis_slipway-41r1 pyxis_other pyxis_slipway-x ubuntu")
    # 30: purged (squeue knows it no more); 31: running; 7: completed.
    lib.stand_in("squeue", 'case "$3" in 31) echo RUNNING ;; 7) echo COMPLETED ;; *) exit 1 ;; esac')
    r = lib.run("sweep_containers 41 41r2 '' 3 list")
    assert r.stdout.splitlines() == ["would remove pyxis_slipway-30", "kept pyxis_slipway-31r2: job 31 is not over",
                                     "would remove pyxis_7_slipway-7", "would remove pyxis_slipway-41",
                                     "would remove pyxis_slipway-41r1"], r.stderr


def _enroot_with_data(lib: Lib, data: Path) -> None:
    """A stand-in enroot keeping containers as directories under `data`, its configuration above
    an END CONFIG line as the real script has it (enroot_data reads it from there)."""
    data.mkdir(parents=True, exist_ok=True)
    lib.stand_in("enroot", f'export ENROOT_DATA_PATH="${{ENROOT_DATA_PATH:-{data}}}"\n'
                           "# ----- END CONFIG -----\n"
                           'case "$1" in list) ls -1 "$ENROOT_DATA_PATH" ;; '
                           'remove) rm -rf "${ENROOT_DATA_PATH:?}/$3" ;; esac')


def test_kept_build_containers_are_bounded_oldest_first_never_one_in_use(tmp_path):
    lib = Lib(tmp_path)
    data = tmp_path / "enroot-data"
    _enroot_with_data(lib, data)
    uses = data / ".slipway"
    uses.mkdir(parents=True)
    for i, (build, jobs) in enumerate([("iccc", "12"), ("ibbb", "31\n13"), ("ieee", "14"), ("iddd", None)]):
        name = f"pyxis_slipway-{build}"
        (data / name / "usr").mkdir(parents=True)
        if jobs is not None:
            (uses / name).write_text(jobs + "\n")
            os.utime(uses / name, (1000 + i, 1000 + i))
    lib.stand_in("squeue", 'case "$3" in 31) echo RUNNING ;; *) exit 1 ;; esac')  # 31 runs: ibbb is in use
    r = lib.run("sweep_containers 41 41 iaaa 2")
    # This job's build (iaaa) is the most recently used, then ieee; ibbb is older but in use;
    # iccc and iddd (no record of a use: the oldest) go.
    assert r.stdout.splitlines() == [
        "kept pyxis_slipway-ieee: among the 2 most recently used builds",
        "kept pyxis_slipway-ibbb: used by job 31, which is not over",
        "removed pyxis_slipway-iccc", "removed pyxis_slipway-iddd"], r.stderr
    assert sorted(p.name for p in data.iterdir()) == [".slipway", "pyxis_slipway-ibbb", "pyxis_slipway-ieee"]
    assert (uses / "pyxis_slipway-iaaa").read_text() == "41\n"
    assert "enroot remove --force .slipway-removing-pyxis_slipway-iccc" in lib.calls()
    # Its container not yet unpacked here, this job's build is not listed; once it is, it is kept.
    (data / "pyxis_slipway-iaaa").mkdir()
    r = lib.run("sweep_containers 42 42 iaaa 1")
    assert r.stdout.splitlines() == ["kept pyxis_slipway-iaaa: this job's build", "removed pyxis_slipway-ieee",
                                     "kept pyxis_slipway-ibbb: used by job 31, which is not over"], r.stderr
    assert (uses / "pyxis_slipway-iaaa").read_text() == "41\n42\n"
    # A job that keeps no container (container.keep_builds: 0) leaves the kept ones alone.
    r = lib.run("sweep_containers 43 43 '' ''")
    assert r.stdout == "" and (data / "pyxis_slipway-ibbb").is_dir() and (data / "pyxis_slipway-iaaa").is_dir()


def test_a_removal_cut_short_is_finished_and_never_reused(tmp_path):
    """A kept container is renamed before its deletion: a job of that build that starts while
    (or after) it is deleted unpacks a fresh one, and the next sweep deletes what is left."""
    lib = Lib(tmp_path)
    data = tmp_path / "enroot-data"
    _enroot_with_data(lib, data)
    (data / ".slipway-removing-pyxis_slipway-iold" / "usr").mkdir(parents=True)
    assert lib.run("sweep_containers 41 41 '' 2").returncode == 0
    assert not (data / ".slipway-removing-pyxis_slipway-iold").exists()


def test_a_build_container_stays_at_the_end_and_is_named_by_the_build(tmp_path):
    lib = Lib(tmp_path, prefix="slipway-", build="i0123456789abcdef")
    r = lib.run('echo "$CONTAINER_NAME"; trap on_exit EXIT; exit 0')
    assert r.stdout.splitlines()[0] == "slipway-i0123456789abcdef", r.stderr
    assert not [c for c in lib.calls() if c.startswith("srun")], lib.calls()  # kept: no removal


def test_a_site_whose_pyxis_removes_named_containers_is_said_once_and_keeps_none(tmp_path):
    lib = Lib(tmp_path, prefix="slipway-", build="i0123456789abcdef")
    conf = tmp_path / "slurm"
    (conf / "plugstack.conf.d").mkdir(parents=True)
    (conf / "plugstack.conf").write_text("optional /usr/lib/other.so\ninclude plugstack.conf.d/*.conf\n")
    pyxis = conf / "plugstack.conf.d" / "pyxis.conf"
    lib.stand_in("scontrol", f'[ "$1 $2" = "show config" ] && echo "PlugStackConfig         = {conf}/plugstack.conf"')
    pyxis.write_text("required /usr/local/lib/slurm/spank_pyxis.so runtime_path=/run/pyxis container_scope=job\n")
    r = lib.run('pyxis_scope; keep_container; keep_container; echo "kept=$KEPT_CONTAINER"')
    assert r.stdout.split() == ["job", "kept="], r.stderr  # pyxis names it per job there: nothing to ready
    assert lib.events() == ["containers: this cluster's pyxis removes named containers at each job's end "
                            "(container_scope=job), so every job unpacks the image and container.keep_builds "
                            "has no effect"]
    pyxis.write_text("required /usr/local/lib/slurm/spank_pyxis.so runtime_path=/run/pyxis\n")
    (lib.run_dir / "events.log").unlink()
    r = lib.run('pyxis_scope; keep_container; echo "kept=$KEPT_CONTAINER"')
    assert r.stdout.split() == ["global", "kept=pyxis_slipway-i0123456789abcdef"] and lib.events() == []
    pyxis.unlink()
    assert lib.run("pyxis_scope").stdout.strip() == ""


def test_the_stale_sweep_runs_in_the_background_on_every_node(tmp_path):
    lib = Lib(tmp_path, prefix="slipway-")
    lib.stand_in("srun", 'while [ "${1#--}" != "$1" ]; do shift; done; "$@"')  # the per-node script here, as one node
    lib.stand_in("enroot", '[ "$1" = list ] && printf "%s\\n" pyxis_slipway-30 pyxis_slipway-41; true')
    lib.stand_in("squeue", "exit 1")
    r = lib.run('remove_stale_containers; wait "${HELPER_PIDS[@]}"')
    assert r.returncode == 0, r.stderr
    srun = [c for c in lib.calls() if c.startswith("srun")]
    assert len(srun) == 1 and srun[0].startswith("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task=1 --overlap"), srun
    assert "enroot remove --force pyxis_slipway-30" in lib.calls()
    assert not any("remove --force pyxis_slipway-41" in c for c in lib.calls())  # this job's own


def test_a_time_limit_stop_without_a_new_checkpoint_is_said(tmp_path):
    lib = Lib(tmp_path)
    r = lib.run("STOP_REQUESTED=1; after_stop_request 1")
    assert r.returncode == 0 and lib.calls() == ["scontrol requeue 41"], r.stderr
    assert lib.events() == ["time-limit requeue 1/3: no checkpoint saved after the stop request (step exit 1), "
                            "requeueing"]


def test_inside_an_allocation_a_stop_or_failure_is_never_requeued(tmp_path):
    """`slipway run` (SLIPWAY_IN_ALLOCATION): Ctrl-C's INT trap asks for a save; the step's
    REQUEUE_EXIT then ends the script with 75 and says how to resume; a hang is not retried."""
    lib = Lib(tmp_path)
    (lib.run_dir / "checkpoints" / "step-7").mkdir(parents=True)
    for name in (".metadata", "COMPLETE"):
        (lib.run_dir / "checkpoints" / "step-7" / name).touch()
    setting = next(line for line in render_settings().splitlines() if "SLIPWAY_IN_ALLOCATION" in line)
    r = lib.run(f"SLIPWAY_IN_ALLOCATION=1; {setting}; trap on_interrupt INT; kill -INT $$; "
                "after_stop_request 75")
    assert r.returncode == 75 and not any(c.startswith("scontrol") for c in lib.calls()), (r.stderr, lib.calls())
    assert lib.events() == ["interrupted: stop requested",
                            "stopped on request: saved after the stop request (checkpoint at step 7); "
                            "slipway run: not requeued, run it again to resume"]
    assert (lib.run_dir / "stop-requested").exists()
    r = lib.run(f"SLIPWAY_IN_ALLOCATION=1; {setting}; retry_or_stop hang 4 node2")
    assert r.returncode == 4 and lib.events()[-1] == ("not retrying (hang): slipway run: not requeued, run it "
                                                      "again to resume")


def render_settings() -> str:
    from jobs.config import load_config
    from jobs.slurm.script import render_sbatch

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml")
    return render_sbatch(cfg, RunDir(Path("/r/run"), Path("/r")), cfg.container)


def test_a_failed_step_on_healthy_nodes_is_no_node_failure(tmp_path):
    lib = Lib(tmp_path)
    lib.stand_in("sinfo", 'printf "node1 alloc\\nnode2 mix\\n"')
    r = lib.run("after_node_failure 1; echo decided-nothing")
    assert r.stdout.strip() == "decided-nothing" and lib.events() == []


def test_a_silent_node_in_a_hang_is_blamed(tmp_path):
    lib = Lib(tmp_path)
    lib.stand_in("sinfo", 'printf "node1 alloc\\nnode2 alloc\\nnode3 idle\\n"')
    lib.stand_in("scontrol", '[ "$1 $2" = "show job" ] && echo "JobId=41 ExcNodeList=(null)"; '
                             '[ "$1 $2" = "show hostnames" ] && tr , "\\n" <<< "$3"; true')
    for rank in (0, 1):
        (lib.run_dir / "hangs" / f"41-node1-{rank}.txt").write_text(
            HangLine(rank, "node1", 9, 20.0, 20.0, on_time=True).line() + "\n")
    r = lib.run("after_hang")
    assert r.returncode == 0, r.stderr
    assert lib.events() == [
        "hang: no step completed for 20 s after step 9; stack dumps from 2 of 4 ranks in hangs/41-*.txt; "
        "not answering in time: 2 of the 2 ranks on node2",
        "bad nodes remembered for cluster alps: node2 (its later jobs exclude them)",
        "retry 1/2 (hang): requeueing without node2 (excluded nodes: node2)"]
    record = BadNode.parse((lib.nodes / "node2").read_text())  # what the cluster's next submission reads
    assert (record.node, record.kind, record.run, record.job) == ("node2", "hang", "run", "41"), record
    assert record.reason == "hang: 2 of its 2 ranks wrote no stack dump in time" and record.since == record.at
    assert [c for c in lib.calls() if not c.startswith(("scontrol show", "sinfo"))] == [
        "scontrol requeuehold 41", "scontrol update JobId=41 ExcNodeList=node2", "scontrol release 41"]


def _wait_for(check, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# ---------------------------------------------------------------- what the job runs, checked on every node


def _snapshot(tmp_path: Path):
    """A real code snapshot, as a submission writes it (jobs/runs/code.py)."""
    from jobs.runs.code import plan_snapshot

    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / "train_mine.py").write_text("print('hi')\n")
    (folder / "tool.sh").write_text("echo x\n")
    (folder / "tool.sh").chmod(0o755)
    (folder / "alias.py").symlink_to("train_mine.py")
    (folder / "name with spaces.py").write_text("X = 1\n")
    return plan_snapshot(tmp_path / "runs" / ".code", str(folder / "train_mine.py")).write()


def test_a_code_snapshot_as_submitted_passes_and_any_change_is_named(tmp_path):
    lib = Lib(tmp_path)
    code = _snapshot(tmp_path)
    snap = Path(code.dir)
    check = f"verify_code {shlex.quote(code.dir)} {code.hash}"
    r = lib.run(check)
    assert r.returncode == 0 and r.stdout == "", (r.stdout, r.stderr)

    def changed(edit, expected: str) -> None:
        for path in [snap, *snap.rglob("*")]:
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
        edit()
        r = lib.run(f"{check} || echo refused")
        assert r.stdout.splitlines() == [expected, "refused"], (r.stdout, r.stderr)

    model = snap / "trainer" / "model.py"
    original = model.read_bytes()
    changed(lambda: (model.chmod(0o644), model.write_bytes(original + b"#")), f"{model} differs from the file submitted")
    model.write_bytes(original)
    lib.run(check).check_returncode()
    spaced = snap / "script" / "name with spaces.py"
    changed(lambda: (spaced.chmod(0o644), spaced.write_text("X = 2\n")), f"{spaced} differs from the file submitted")
    spaced.write_text("X = 1\n")
    changed(lambda: (snap / "trainer" / "evil.py").write_text("x"), f"{snap}/trainer/evil.py was added after submission")
    (snap / "trainer" / "evil.py").unlink()
    # A rank's import caches bytecode beside the sources (no PYTHONDONTWRITEBYTECODE in a user's
    # shell): the snapshot is still the one submitted, and its next launch runs; nothing else there is.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, "-c", "import trainer.model, common.errors"], cwd=snap, env=env, check=True)
    assert list(snap.glob("trainer/__pycache__/model.*.pyc"))
    lib.run(check).check_returncode()
    cache = snap / "trainer" / "__pycache__"
    (cache / "model.cpython-311.pyc.140234567").write_bytes(b"\0")  # a rank on another node writing it now
    lib.run(check).check_returncode()
    (cache / "model.cpython-311.pyc.140234567").unlink()
    changed(lambda: (cache / "evil.py").write_text("x"), f"{cache}/evil.py was added after submission")
    (cache / "evil.py").unlink()
    changed(lambda: (cache / "x.pyc.sh").write_text("x"), f"{cache}/x.pyc.sh was added after submission")
    (cache / "x.pyc.sh").unlink()
    changed(lambda: (cache / "deeper").mkdir() or (cache / "deeper" / "x.pyc").write_text("x"),
            f"{cache}/deeper/x.pyc was added after submission")
    shutil.rmtree(cache / "deeper")
    changed(lambda: (cache / "link.pyc").symlink_to("/etc/passwd"), f"{cache}/link.pyc was added after submission")
    (cache / "link.pyc").unlink()
    shutil.rmtree(cache)
    changed(lambda: cache.symlink_to(tmp_path), f"{cache} was added after submission")  # a cache that is a link out
    cache.unlink()
    data = snap / "trainer" / "data.py"
    kept = data.read_bytes()
    changed(data.unlink, f"{data} is missing")
    data.write_bytes(kept)
    changed(lambda: ((snap / "script" / "alias.py").unlink(), (snap / "script" / "alias.py").symlink_to("/etc/passwd")),
            f"{snap}/script/alias.py differs from the link submitted")
    (snap / "script" / "alias.py").unlink()
    (snap / "script" / "alias.py").symlink_to("train_mine.py")
    changed(lambda: (snap / "script" / "tool.sh").chmod(0o644),
            f"{snap}/script/tool.sh is missing or no longer executable")
    (snap / "script" / "tool.sh").chmod(0o555)
    lib.run(check).check_returncode()
    listing = snap / ".slipway-files"
    changed(lambda: (listing.chmod(0o644), listing.write_text(listing.read_text().replace("model.py", "modeL.py"))),
            f"{listing} is not the listing recorded at submission")
    r = lib.run(f"verify_code {shlex.quote(str(tmp_path / 'gone'))} {code.hash} || echo refused")
    assert r.stdout.splitlines() == [f"the code snapshot {tmp_path / 'gone'} is not there (removed after submission, "
                                     "or this node does not see its filesystem)",
                                     "refused"]


def test_an_image_is_vouched_for_by_its_stat_then_by_its_bytes(tmp_path):
    import hashlib

    lib = Lib(tmp_path)
    image = tmp_path / "img dir" / "image.sqsh"
    image.parent.mkdir()
    image.write_bytes(b"squashfs" * 1000)
    st = image.stat()
    sha = hashlib.sha256(image.read_bytes()).hexdigest()
    q = shlex.quote(str(image))
    assert lib.run(f"verify_image {q} '' {st.st_size} {int(st.st_mtime)}").stdout == ""
    os.utime(image, (st.st_atime, st.st_mtime + 100))  # touched, same bytes: the hash vouches for it
    assert lib.run(f"verify_image {q} {sha} {st.st_size} {int(st.st_mtime)}").returncode == 0
    r = lib.run(f"verify_image {q} '' {st.st_size} {int(st.st_mtime)} || echo refused")  # no hash to ask
    assert r.stdout.splitlines()[-1] == "refused" and "changed after submission" in r.stdout
    image.write_bytes(b"other" * 1000)
    r = lib.run(f"verify_image {q} {sha} {st.st_size} {int(st.st_mtime)} || echo refused")
    assert r.stdout.startswith(f"the image {image} changed after submission (size 5000 bytes, submitted 8000 bytes; "
                               "its bytes differ)") and r.stdout.splitlines()[-1] == "refused"
    image.unlink()
    r = lib.run(f"verify_image {q} {sha} 8000 1 || echo refused")
    assert r.stdout.splitlines() == [f"the image {image} is not there (removed or moved after submission, or this "
                                     "node does not see its filesystem): restore it, or build the image again and "
                                     "submit again", "refused"]
    assert lib.run("verify_image '' '' '' ''").returncode == 0  # a registry image: nothing on disk to check


def _enroot_unpacking(lib: Lib, data: Path, seconds: float = 0.0) -> None:
    """A stand-in enroot whose `create` unpacks slowly, file by file, as a real one does (a second
    unpack into the same name fails on "File exists", as enroot's does)."""
    data.mkdir(parents=True, exist_ok=True)
    lib.stand_in("enroot", f'export ENROOT_DATA_PATH="${{ENROOT_DATA_PATH:-{data}}}"\n'
                           "# ----- END CONFIG -----\n"
                           'case "$1" in\n'
                           '  list) ls -1 "$ENROOT_DATA_PATH" ;;\n'
                           '  remove) rm -rf "${ENROOT_DATA_PATH:?}/$3" ;;\n'
                           '  create) d="$ENROOT_DATA_PATH/$3"\n'
                           '    [ -e "$d" ] && { echo "[ERROR] File already exists: $d" >&2; exit 1; }\n'
                           '    [ -f "$4" ] || { echo "[ERROR] No such file or directory: $4" >&2; exit 1; }\n'
                           f'    mkdir -p "$d/usr"; for i in 1 2 3 4 5; do sleep {seconds}; touch "$d/usr/f$i"; done ;;\n'
                           'esac')


def test_two_jobs_of_one_build_on_one_node_unpack_its_container_once(tmp_path):
    """Started at the same moment, both jobs get the whole container; enroot unpacks it once."""
    lib = Lib(tmp_path)
    data = tmp_path / "enroot-data"
    _enroot_unpacking(lib, data, seconds=0.2)
    image = tmp_path / "image.sqsh"
    image.write_bytes(b"x")
    name = "pyxis_slipway-i0123456789abcdef"
    procs = [subprocess.Popen(["bash", "-c", lib.script(f"ensure_container {name} {image} IDENT && echo ready")],
                              env=lib.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    # The one that unpacked says so (node_check's `ok, unpacked in N s`), the other nothing.
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted(re.sub(r"\d+ s", "N s", o[0]) for o in outs) == ["ready\n", "unpacked in N s\nready\n"], outs
    assert sorted(p.name for p in (data / name / "usr").iterdir()) == ["f1", "f2", "f3", "f4", "f5"]
    creates = [c for c in lib.calls() if c.startswith("enroot create")]
    assert len(creates) == 1 and re.fullmatch(rf"enroot create --name \.slipway-unpacking-{name}\.\d+ {image}",
                                              creates[0]), creates
    assert (data / ".slipway" / f"{name}.ready").read_text() == "IDENT\n"
    assert not [p for p in data.iterdir() if p.name.startswith(".slipway-unpacking")]


def test_a_container_without_its_mark_is_unpacked_again(tmp_path):
    """An unpack cut short (a directory and no mark), or one of another image under the same name,
    is never started in: it is removed and unpacked whole."""
    lib = Lib(tmp_path)
    data = tmp_path / "enroot-data"
    _enroot_unpacking(lib, data)
    image = tmp_path / "image.sqsh"
    image.write_bytes(b"x")
    name = "pyxis_slipway-i0123456789abcdef"
    (data / name / "usr").mkdir(parents=True)
    (data / name / "usr" / "f1").touch()  # 1 file of 5: what a killed unpack leaves
    (data / f".slipway-unpacking-{name}.999" / "usr").mkdir(parents=True)  # an unpack killed midway
    lib.run(f"ensure_container {name} {image} IDENT").check_returncode()
    assert len(list((data / name / "usr").iterdir())) == 5
    assert not (data / f".slipway-unpacking-{name}.999").exists()
    assert "enroot remove --force .slipway-unpacking-" + name + ".999" in lib.calls()
    creates = len([c for c in lib.calls() if c.startswith("enroot create")])
    lib.run(f"ensure_container {name} {image} IDENT").check_returncode()  # complete: reused as it is
    assert len([c for c in lib.calls() if c.startswith("enroot create")]) == creates
    (data / ".slipway" / f"{name}.ready").write_text("OTHER\n")  # marked for another image
    lib.run(f"ensure_container {name} {image} IDENT").check_returncode()
    assert len([c for c in lib.calls() if c.startswith("enroot create")]) == creates + 1
    r = lib.run(f"ensure_container {name} {tmp_path / 'missing.sqsh'} NEW || echo refused")
    assert r.stdout.splitlines()[-1] == "refused" and "enroot could not unpack" in r.stdout
    assert not [p for p in data.iterdir() if p.name.startswith(".slipway-unpacking")]


def test_the_sweep_never_removes_a_container_being_unpacked(tmp_path):
    lib = Lib(tmp_path)
    data = tmp_path / "enroot-data"
    _enroot_unpacking(lib, data)
    name = "pyxis_slipway-iold"
    (data / name / "usr").mkdir(parents=True)
    (data / ".slipway").mkdir()
    holder = subprocess.Popen(["flock", str(data / ".slipway" / f"{name}.lock"), "sleep", "30"], start_new_session=True)
    try:
        _wait_for(lambda: subprocess.run(["flock", "-n", str(data / ".slipway" / f"{name}.lock"), "true"]).returncode)
        r = lib.run("sweep_containers 41 41 iaaa 0")
        assert f"kept {name}: a job is unpacking it" in r.stdout.splitlines(), (r.stdout, r.stderr)
        assert (data / name).is_dir()
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # flock and the sleep that holds its lock
        holder.wait()
    r = lib.run("sweep_containers 42 42 iaaa 0")
    assert f"removed {name}" in r.stdout.splitlines() and not (data / name).exists()


def test_verify_nodes_ends_a_job_whose_code_differs_without_retry_or_blame(tmp_path):
    lib = Lib(tmp_path)
    code = _snapshot(tmp_path)
    lib.stand_in("srun", 'while [ "${1#--}" != "$1" ]; do shift; done\n'
                         'for n in node1 node2; do SLURMD_NODENAME=$n "$@"; done')
    setting = f"CODE_DIR={shlex.quote(code.dir)} CODE_SHA256={code.hash}"
    r = lib.run(f"{setting}; verify_nodes; echo verified")
    assert r.stdout.strip() == "verified" and lib.events() == [], (r.stdout, r.stderr)
    model = Path(code.dir) / "trainer" / "model.py"
    model.chmod(0o644)
    model.write_text("# edited after submission\n")
    r = lib.run(f"{setting}; verify_nodes; echo verified")
    assert r.returncode == 2 and "verified" not in r.stdout
    assert lib.events() == [f"verification failed: {model} differs from the file submitted (on node1)"]
    assert not [c for c in lib.calls() if c.startswith("scontrol requeue")]


def test_verify_nodes_retries_without_a_node_that_sent_no_report(tmp_path):
    lib = Lib(tmp_path)
    lib.stand_in("srun", 'while [ "${1#--}" != "$1" ]; do shift; done\nSLURMD_NODENAME=node1 "$@"; exit 1')
    lib.stand_in("sinfo", 'printf "node1 alloc\\nnode2 alloc\\nnode3 idle\\n"')
    lib.stand_in("scontrol", '[ "$1 $2" = "show job" ] && echo "JobId=41 ExcNodeList=(null)"; '
                             '[ "$1 $2" = "show hostnames" ] && tr , "\\n" <<< "$3"; true')
    r = lib.run("CODE_DIR='' CODE_SHA256=''; verify_nodes; echo verified")
    assert r.returncode == 0 and "verified" not in r.stdout, r.stderr
    assert lib.events() == ["preflight failed on node2: no verification report: the step ended after 0 s (exit 1) "
                            "without one",
                            "bad nodes remembered for cluster alps: node2 (its later jobs exclude them)",
                            "retry 1/2 (preflight): requeueing without node2 (excluded nodes: node2)"]


def test_verify_nodes_leaves_out_a_node_that_does_not_see_what_the_others_see(tmp_path):
    """The snapshot missing on one node of two (its shared filesystem not mounted there) is that
    node's failure, not the run's: the job is retried without it."""
    lib = Lib(tmp_path)
    code = _snapshot(tmp_path)
    lib.stand_in("srun", 'while [ "${1#--}" != "$1" ]; do shift; done\n'
                         'SLURMD_NODENAME=node1 "$@"\n'
                         'set -- "${@:1:5}" /not/mounted/here "${@:7}"; SLURMD_NODENAME=node2 "$@"')  # CODE_DIR
    lib.stand_in("sinfo", 'printf "node1 alloc\\nnode2 alloc\\nnode3 idle\\n"')
    lib.stand_in("scontrol", '[ "$1 $2" = "show job" ] && echo "JobId=41 ExcNodeList=(null)"; '
                             '[ "$1 $2" = "show hostnames" ] && tr , "\\n" <<< "$3"; true')
    r = lib.run(f"CODE_DIR={shlex.quote(code.dir)} CODE_SHA256={code.hash}; verify_nodes; echo verified")
    assert r.returncode == 0 and "verified" not in r.stdout, r.stderr
    assert lib.events() == ["preflight failed on node2: the code snapshot /not/mounted/here is not there (removed "
                            "after submission, or this node does not see its filesystem)",
                            "bad nodes remembered for cluster alps: node2 (its later jobs exclude them)",
                            "retry 1/2 (preflight): requeueing without node2 (excluded nodes: node2)"]


# ---------------------------------------------------------------- what a job leaves for the next ones (bad_nodes_lib.sh, requeue_lib.sh)


def test_a_blamed_node_is_remembered_with_its_first_blame_and_a_clean_preflight_clears_it(tmp_path):
    lib = Lib(tmp_path)
    r = lib.run('BLAME[node2]="preflight failed: bad GPU"; remember_bad_nodes preflight node2')
    assert r.returncode == 0, r.stderr
    first = BadNode.parse((lib.nodes / "node2").read_text())
    assert (first.kind, first.reason, first.run, first.job) == ("preflight", "preflight failed: bad GPU", "run", "41")
    time.sleep(1.1)
    lib.run('remember_bad_nodes "node failure" node2').check_returncode()  # blamed again: since stands
    again = BadNode.parse((lib.nodes / "node2").read_text())
    assert again.since == first.since and again.at > first.at and again.kind == "node-failure"
    assert again.reason == "node failure"
    lib.run("clear_bad_node node1; clear_bad_node node2").check_returncode()
    assert not (lib.nodes / "node2").exists()
    assert lib.events()[-1] == f"bad node node2 cleared for cluster alps: a clean preflight (remembered since {first.since})"
    assert [e for e in lib.events() if "node1" in e] == []  # nothing remembered of it, nothing said


def test_jobs_blaming_nodes_at_once_never_tear_a_record(tmp_path):
    lib = Lib(tmp_path)
    procs = [subprocess.Popen(["bash", "-c", lib.script(f'BLAME[{node}]="hang: writer {i}"; '
                                                        f"remember_bad_nodes hang {node}")],
                              env=lib.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(12) for node in ("node1", "node2")]
    assert [p.wait(timeout=60) for p in procs] == [0] * len(procs)
    for node in ("node1", "node2"):
        record = BadNode.parse((lib.nodes / node).read_text())
        assert record is not None and record.node == node and record.reason.startswith("hang: writer ")
    assert sorted(p.name for p in lib.nodes.iterdir()) == ["node1", "node2"]  # no temporary left behind


def test_a_record_that_cannot_be_written_or_read_never_stops_the_job(tmp_path):
    lib = Lib(tmp_path)
    lib.nodes.mkdir(parents=True)
    os.mkfifo(lib.nodes / "node1")  # a FIFO where a record would be: never opened, never blocks
    r = lib.run("clear_bad_node node1; remember_bad_nodes hang node1; echo went-on")
    assert r.stdout.strip() == "went-on", r.stderr
    assert lib.events() == ["bad nodes remembered for cluster alps: node1 (its later jobs exclude them)"]
    assert BadNode.parse((lib.nodes / "node1").read_text()).kind == "hang"  # replaced whole, by rename
    lib.nodes.chmod(0o500)
    try:
        r = lib.run('remember_bad_nodes hang node2 "../../etc/x"; echo went-on')
    finally:
        lib.nodes.chmod(0o700)
    if os.geteuid() != 0:  # root writes anyway
        assert f"could not remember node2 as a bad node of cluster alps (in {lib.nodes})" in lib.events()
    assert r.stdout.strip() == "went-on" and "could not remember ../../etc/x as a bad node of cluster alps " \
        f"(in {lib.nodes})" in lib.events()
    assert not (tmp_path / "etc").exists()


def test_a_passed_preflight_sums_the_nodes_write_speed(tmp_path):
    lib = Lib(tmp_path)
    log = tmp_path / "preflight.out"
    log.write_text("slipway-preflight node1 ok: run directory writable; writes 2.0 MiB/s where checkpoints go "
                   "write_bps=2097152\nslipway-preflight node2 ok: writes 1.0 MiB/s where checkpoints go "
                   "write_bps=1048576\n")
    r = lib.run(f'preflight_nodes {shlex.quote(str(log))} 0; echo "$WRITE_BPS"')
    assert r.stdout.strip() == str(3 << 20), r.stderr


def _saves(lib: Lib, *lines: str) -> None:
    (lib.run_dir / "saves.log").write_text("".join(line + "\n" for line in lines))


def test_the_warning_lead_is_the_slowest_recent_save_plus_the_steps_plus_a_margin(tmp_path):
    from common.rundir import SaveLine

    lib = Lib(tmp_path)
    assert lib.run("warning_lead").stdout == "300 no save and no write speed measured yet: a tenth of the time limit\n"
    # Before the first save: a 1 GiB checkpoint at the 4 MiB/s the preflight measured.
    assert lib.run("WRITE_BPS=4194304; warning_lead").stdout.startswith(
        "338 no save yet: about 1024 MiB at the 4096 KiB/s the preflight measured where checkpoints go take 257 s, "
        "+ 0 s to the next stop point (10 step(s)), + 81 s margin")
    old = [SaveLine(step, 900_000, 10, 100, "t").line() for step in (10, 20)]  # slow, but six saves ago and more
    recent = [SaveLine(step, ms, 10, 2500, "t").line() for step, ms in ((30, 40_000), (40, 95_500), (50, 41_000),
                                                                          (60, 42_000), (70, 39_000))]
    _saves(lib, *old, "garbage line", "slipway-save step=x ms=oops", *recent)
    assert lib.run("WRITE_BPS=4194304; warning_lead").stdout == (  # measured saves win over the estimate
        "162 the slowest of the run's last 5 save(s) took 96 s, + 25 s to the next stop point (10 step(s)), "
        "+ 54 s margin\n".replace("162", str(96 + 25 + 54)))
    _saves(lib, SaveLine(1, 100, 10, 10, "t").line())
    assert lib.run("warning_lead").stdout.startswith("60 the slowest of the run's last 1 save(s) took 1 s") and \
        "at least 60 s, Slurm's own warning" in lib.run("warning_lead").stdout
    _saves(lib, SaveLine(1, 5_000_000, 10, 10, "t").line())
    assert lib.run("warning_lead").stdout.startswith("1800 ") and "at most 1800 s, half the time limit: raise " \
        "slurm.time for saves this slow" in lib.run("warning_lead").stdout


def test_the_timer_asks_for_the_save_at_the_lead_before_the_jobs_end(tmp_path):
    """The job's end from squeue, the lead from the run's saves: the batch shell gets USR1 (on_warning)
    when the time left reaches the lead, and events.log says the lead and why."""
    from datetime import datetime, timedelta

    from common.rundir import SaveLine

    lib = Lib(tmp_path)
    _saves(lib, SaveLine(10, 1000, 10, 0, "t").line())  # lead: 1 + 0 + 30 margin -> LEAD_MIN (set to 31 below)
    end = (datetime.now() + timedelta(seconds=35)).strftime("%Y-%m-%dT%H:%M:%S")
    lib.stand_in("squeue", f'echo {end}')
    start = time.monotonic()
    r = lib.run('LEAD_MIN=31; trap on_warning USR1; STOP_CHECKPOINT=0\n'
                'warning_timer & t=$!\n'
                'while [ "$STOP_REQUESTED" != 1 ]; do sleep 0.2; done; kill "$t" 2>/dev/null || true; echo asked')
    took = time.monotonic() - start
    said = r.stdout.strip().splitlines()
    assert said[-1] == "asked" and said[0].startswith("slipway: the time limit is near"), (r.stdout, r.stderr)
    assert 2 <= took <= 30, took  # at the end less the lead (35 - 31 s), not Slurm's floor
    assert lib.events()[:2] == ["warning lead 31 s: the slowest of the run's last 1 save(s) took 1 s, + 0 s to the next "
                                "stop point (10 step(s)), + 30 s margin", "time limit warning: stop requested"]
    assert (lib.run_dir / "stop-requested").exists()
    r = lib.run("STOP_REQUESTED=1; on_warning; echo $TRAPPED")  # Slurm's own warning after the timer's: once
    assert r.stdout.strip() == "1" and lib.events().count("time limit warning: stop requested") == 1


def test_a_requeue_by_slurm_is_a_preemption_counted_apart(tmp_path):
    lib = Lib(tmp_path)
    log = lib.run_dir / "events.log"
    earlier = "".join(f"2026-01-01T00:00:00+00:00 job 41 an earlier attempt's event {i}\n" for i in range(20000))
    log.write_text(earlier + "2026-01-01T00:00:00+00:00 job 41 start on node1 (restart 0), failure retries 0/2, time-limit "
                   "requeues 0/3\n2026-01-01T00:01:00+00:00 job 41 cancelled (SIGTERM)\n"
                   "2026-01-01T00:01:00+00:00 job 41 end exit 143\n")
    r = lib.run('SLURM_RESTART_COUNT=1; note_preemption; echo "$PREEMPTIONS|$PREEMPTIONS_SAID"')
    assert r.stdout.strip() == "1|, preemptions 1", r.stderr
    assert lib.events()[-1] == ("preempted: requeued by Slurm (a preemption, or scontrol requeue) in its previous "
                                "attempt; preemption 1, counted apart from failure retries and time-limit requeues")
    with log.open("a") as f:  # the next attempt requeued itself at the time-limit warning: no preemption
        f.write("2026-01-01T00:02:00+00:00 job 41 start on node1 (restart 1), failure retries 0/2, time-limit "
                "requeues 0/3, preemptions 1\n2026-01-01T00:09:00+00:00 job 41 time-limit requeue 1/3: saved, "
                "requeueing\n2026-01-01T00:09:01+00:00 job 41 could not exclude x\n"
                "2026-01-01T00:09:01+00:00 job 41 end exit 0\n")
    r = lib.run('SLURM_RESTART_COUNT=2 PREEMPTIONS=$(count_events preempted:); note_preemption; echo "$PREEMPTIONS"')
    assert r.stdout.strip() == "1" and lib.events()[-1] == "end exit 0", lib.events()
    assert lib.run("note_preemption; echo \"[$PREEMPTIONS_SAID]\"").stdout.strip() == "[]"  # a first attempt
def test_warm_up_keeps_one_key_and_starts_warm_processes_only_where_none_answers(tmp_path):
    """`slipway run`'s warm processes (jobs/slurm/warm.py): verify_nodes finds each node's by the
    socket it listens on in the user's folder (here ones this test binds), warm_up asks the
    allocation's warm steps of another key to stop and starts one on the nodes that lack theirs,
    waiting until it bound; a socket file nobody listens on, or one outside a folder of the user's,
    is none. Where Slurm tracks the job's processes by cgroup, no warm process is kept."""
    import socket

    lib = Lib(tmp_path)
    folder = Path(tempfile.mkdtemp(prefix="slipway-warm-", dir="/tmp"))  # a socket's path is 107 bytes at most
    lib.stand_in("srun", 'while [ "${1#--}" != "$1" ]; do shift; done\n'
                         'for n in node1 node2; do SLURMD_NODENAME=$n "$@"; done')
    lib.stand_in("squeue", 'printf "41.3 slipway-warm-0ld\\n41.4 slipway-warm-k3y\\n41.5 bash\\n"')
    lib.stand_in("scancel", "")
    setting = ("CODE_DIR='' CODE_SHA256=''; SLIPWAY_WARM_ID=k3y WARM_CLIENT=(x) WARM_COLD=''; SLURM_JOB_ID=41; "
               f"WARM_SOCKET={folder}/41-k3y; WARM_LOG={tmp_path / 'warm' / 'w.out'}; "
               'warm_start() { echo "warm_start $*" >> "$CALLS"; '
               '( sleep 0.3; echo "slipway-warm node1 bound"; echo "slipway-warm node2 already served" ) > "$WARM_LOG" & '
               'WARM_PID=$!; }; ')
    stale, listening = folder / "41-k3y-node1.sock", []
    step = Path(f"/sys/fs/cgroup/pids/slipway-test-{os.getpid()}/job_41/step_0")
    bound = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    bound.bind(str(stale))
    bound.close()  # the file stays, nobody listens
    try:
        r = lib.run(setting + 'verify_nodes; echo "cold: $WARM_COLD"; warm_up')
        assert r.returncode == 0 and "cold: node1 node2" in r.stdout, (r.stdout, r.stderr)
        assert "warm_start node1,node2 2" in lib.calls() and "scancel --signal=TERM 41.3" in lib.calls()
        assert not [c for c in lib.calls() if "41.4" in c or "41.5" in c]
        assert lib.events() == ["warm: stopping the warm processes of step 41.3 (another key)",
                                f"warm: started the warm processes on node1 node2 (key k3y, log {tmp_path / 'warm' / 'w.out'})"]
        stale.unlink()
        for node in ("node1", "node2"):  # each node's warm process listens: none started
            listening.append(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET))
            listening[-1].bind(f"{folder}/41-k3y-{node}.sock")
            listening[-1].listen(1)
        (tmp_path / "calls.log").unlink()
        (lib.run_dir / "events.log").unlink()
        r = lib.run(setting + "verify_nodes; warm_up")
        assert r.returncode == 0 and not [c for c in lib.calls() if c.startswith("warm_start")], r.stderr
        assert lib.events()[-1] == "warm: the warm processes of key k3y are up on node1 node2"
        # Each node's warm process runs the preflight's node check with the verification (WARM_CHECK,
        # from the host): its lines are the node step's log, and no node step runs. A node whose warm
        # process did not take it (said in events.log) runs the node step, for every node.
        check = ('WARM_CHECK=(10 /no/python3 bash -c \'if [ "$SLURMD_NODENAME" = "$0" ]; then echo "slipway-warm $0: the node '
                 'step runs in a step of its own: it stops" >&2; exit 3; fi; echo "slipway-preflight $SLURMD_NODENAME '
                 'ok: fine"\' {}); PREFLIGHT_LOG=$CALLS.pf; verify_nodes; ')
        r = lib.run(setting + check.format("none") + 'checked_warm && cat "$PREFLIGHT_LOG"')
        assert r.returncode == 0 and r.stdout.split("\n")[:2] == ["slipway-preflight node1 ok: fine",
                                                                   "slipway-preflight node2 ok: fine"], r
        r = lib.run(setting + check.format("node2") + 'checked_warm || echo "node step"')
        assert r.stdout.strip() == "node step" and lib.events()[-1] == \
            "warm: on node2, the node step runs in a step of its own: it stops", (r, lib.events())
        r = lib.run(setting + "WARM_CHECK=(10 /no/python3 /no/python3 -S warm.py); verify_nodes; checked_warm || echo node step")
        assert r.returncode == 0 and r.stdout.strip() == "node step", r  # the host has no such interpreter
        # The client by the interpreter slipway runs under, where the node has it (a PATH's python3
        # can be a wrapper that costs more than the check), else by the fallback; each bounded by LIMIT.
        lib.stand_in("mine", 'echo "slipway-preflight $SLURMD_NODENAME ok: by $0 $*"')
        r = lib.run(setting + f'WARM_CHECK=(10 {tmp_path / "bin" / "mine"} /no/python3 -S w.py); PREFLIGHT_LOG=$CALLS.pf; '
                    'verify_nodes; checked_warm && cat "$PREFLIGHT_LOG"')
        assert r.stdout.split("\n")[:2] == [f"slipway-preflight node{i} ok: by {tmp_path / 'bin' / 'mine'} -S w.py"
                                            for i in (1, 2)], r
        r = lib.run(setting + "WARM_CHECK=(1 /no/python3 sleep 30); s=$SECONDS; verify_nodes; checked_warm || "
                    'echo "node step after $((SECONDS - s)) s"')
        took = r.stdout.strip().removeprefix("node step after ").removesuffix(" s")
        assert took.isdigit() and int(took) < 20, r  # 1 s on each node, not the 30 s the check would take
        folder.chmod(0o755)
        os.chown(folder, 65534, 65534)  # the same sockets in a folder that is not the user's: none there
        r = lib.run(setting + 'verify_nodes; echo "cold: $WARM_COLD"')
        assert "cold: node1 node2" in r.stdout or os.geteuid() != 0, r.stdout
        # Processes tracked by cgroup: each step's in a cgroup of this job's, as Slurm's plugins make
        # them (a real one, where this machine lets root make it). No warm process, no client.
        try:
            step.mkdir(parents=True)
        except OSError as exc:
            pytest.skip(f"no cgroup to put a step in here ({exc.strerror}): the rest passed")
        lib.stand_in("srun", f'echo $$ > {step}/cgroup.procs\nwhile [ "${{1#--}}" != "$1" ]; do shift; done\n'
                             'for n in node1 node2; do SLURMD_NODENAME=$n "$@"; done')
        r = lib.run(setting + 'verify_nodes; warm_up; echo "client: ${WARM_CLIENT[*]}."')
        assert "client: ." in r.stdout and "slipway: warm ranks are off here: Slurm tracks" in r.stdout, r.stdout
        assert lib.events()[-1].startswith("warm: off: Slurm tracks this job's processes by cgroup (on node2)")
    finally:
        for sock in listening:
            sock.close()
        shutil.rmtree(folder)
        for level in (step, step.parent, step.parent.parent):
            with contextlib.suppress(OSError):
                level.rmdir()
