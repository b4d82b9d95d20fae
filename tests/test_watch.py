"""`slipway watch` (jobs/cli/watch.py): its parts on made-up run directories, and the real thing in a
terminal (tmux: send-keys, capture-pane) against a job running on the local Slurm cluster."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
from rich.console import Console

from jobs import runs, slurm
from jobs.cli import watch
from jobs.runs import lifecycle
from jobs.runs.manifest import Launch
from common.rundir import RunDir

PY = sys.executable

DMON = """\
#Date       Time        gpu    pwr  gtemp  mtemp     sm    mem    enc    dec    jpg    ofa     fb   bar1   ccpm  rxpci  txpci
#YYYYMMDD   HH:MM:SS    Idx      W      C      C      %      %      %      %      %      %     MB     MB     MB   MB/s   MB/s
 20260101   12:00:00      0     75     40      -     10      1      0      0      0      0    512      5      0      0      0
 20260101   12:00:00      1     76     41      -     20      1      0      0      0      0    512      5      0      0      0
 20260101   12:00:15      0    650     70      -     96     40      0      0      0      0  61440      5      0      0      0
 20260101   12:00:15      1    640     69      -     98     41      0      0      0      0  61440      5      0      0      0
"""


def test_gpu_use_is_the_latest_sample_of_each_gpu(tmp_path):
    path = tmp_path / "node1.gutil"
    path.write_text(DMON)
    gpus, sm, gib = watch.parse_gutil(path)
    assert (gpus, sm, gib) == (2, 97.0, 120.0)
    assert watch.parse_gutil(tmp_path / "missing.gutil") == (0, None, None)
    path.write_text(DMON.splitlines()[0] + "\n 20260101 12:00:00 0 75\n")  # a cut line
    assert watch.parse_gutil(path) == (0, None, None)


def fake_run(tmp_path: Path, job_id: str = "51") -> runs.Run:
    run_dir = tmp_path / "runs" / "r"
    (run_dir / "heartbeats").mkdir(parents=True)
    (run_dir / "gutil").mkdir()
    (run_dir / "manifest.json").write_text(json.dumps({"submissions": [{"job_id": job_id, "kind": "train"}]}))
    (run_dir / "config.yaml").write_text(Path("configs/tiny_cpu.yaml").read_text().replace("steps: 200", "steps: 90"))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 40, "loss": 3.25, "tokens_per_s": 12345.0,
                                                       "mfu": 0.412, "eta_s": 125}) + "\n")
    logged = time.time() - 30  # the last logged step was a while ago; progress.json is newer
    os.utime(run_dir / "metrics.jsonl", (logged, logged))
    (run_dir / "progress.json").write_text(json.dumps({"step": 42, "unix": time.time() - 7, "hang_timeout": 600}))
    for node in ("node1", "node2"):
        (run_dir / "heartbeats" / node).write_text("now\n")
    old = time.time() - 100
    os.utime(run_dir / "heartbeats" / "node2", (old, old))
    (run_dir / "gutil" / "node1.gutil").write_text(DMON)
    (run_dir / "events.log").write_text(
        f"2026-01-01T12:00:00+00:00 job {job_id} start on node[1-2] (restart 0), failure retries 0/2, time-limit "
        "requeues 0/20\n"
        f"2026-01-01T12:00:09+00:00 job {job_id} preflight ok on node[1-2]: all-reduce of 4 MiB over 4 ranks on 2 "
        "node(s) (gloo): 0.40 GB/s bus bandwidth, 15.6 ms each\n")
    return runs.Run(RunDir(run_dir, tmp_path))


def screen(renderable) -> str:
    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def test_a_frame_shows_progress_nodes_and_events(tmp_path, monkeypatch):
    run = fake_run(tmp_path)
    monkeypatch.setattr(slurm, "job_info", lambda job_id: slurm.JobInfo(job_id, "RUNNING", "0:0", "", "00:01:10",
                                                                          "node[1-2]"))
    monkeypatch.setattr(slurm, "hostnames", lambda nodelist: ["node1", "node2"])
    text = screen(watch.render(watch.Watcher(run, "51").snapshot()))
    assert "run r  job 51  RUNNING  on node[1-2]  elapsed 00:01:10" in text
    # progress.json is ahead of the last logged step; its age is the time since the last step.
    assert re.search(r"step 42/90\s+loss 3\.2500\s+12,345 tokens/s\s+MFU 41\.2%\s+ETA 2m05s\s+last step 7s ago", text), text
    assert re.search(r"node1\s+│\s+\ds ago\s+│\s+2\s+│\s+97%\s+│\s+120\.0 GiB", text), text
    assert re.search(r"node2\s+│\s+1m4\ds ago\s+│\s+-", text), text
    assert "12:00:09 │ job 51 preflight ok on node[1-2]: all-reduce of 4 MiB" in text


def test_watch_follows_the_job_to_its_end_and_exits_with_its_code(tmp_path, monkeypatch):
    run = fake_run(tmp_path)
    states = iter(["PENDING", "RUNNING", "REQUEUED", "RUNNING", "FAILED"])
    monkeypatch.setattr(slurm, "job_info", lambda job_id: slurm.JobInfo(
        job_id, state := next(states), "4:0" if state == "FAILED" else "0:0", "", "1", "node[1-2]"))
    monkeypatch.setattr(slurm, "hostnames", lambda nodelist: ["node1", "node2"])
    out = Console(file=io.StringIO(), width=160, color_system=None)
    assert watch.watch(run, interval=0.01, console=out) == 4
    assert "job 51 ended: FAILED, exit code 4" in out.file.getvalue()


def test_ctrl_c_stops_watching_and_says_the_job_goes_on(tmp_path, monkeypatch):
    run = fake_run(tmp_path)
    monkeypatch.setattr(slurm, "job_info", lambda job_id: slurm.JobInfo(job_id, "RUNNING", "0:0", "", "1", "n1"))

    def interrupt(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(watch.time, "sleep", interrupt)
    out = Console(file=io.StringIO(), width=160, color_system=None)
    assert watch.watch(run, interval=1, console=out) == 130
    from common.environ import as_typed  # the command as this shell runs slipway

    assert as_typed("stopped watching; job 51 goes on (`slipway cancel r` ends it)") in out.file.getvalue()


def test_a_forgotten_job_ends_with_the_code_events_log_gives(tmp_path, monkeypatch):
    run = fake_run(tmp_path)
    with (run.dir / "events.log").open("a") as f:
        f.write("2026-01-01T12:05:00+00:00 job 51 end exit 5\n")
    monkeypatch.setattr(slurm, "job_info", lambda job_id: None)
    out = Console(file=io.StringIO(), width=160, color_system=None)
    assert watch.watch(run, interval=0.01, console=out) == 5


def dead_pid() -> int:
    """The pid of a process that has exited (a launcher or trainer that died)."""
    return int(subprocess.run([PY, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout)


@pytest.mark.parametrize("kinds, latest", [(["train", "prepare"], "51"), (["prepare"], "51"),
                                            (["train", "train", "prepare"], "52")])
def test_the_job_watched_is_the_latest_training_job_else_the_preparation(tmp_path, kinds, latest):
    run = fake_run(tmp_path)
    (run.dir / "manifest.json").write_text(json.dumps({"submissions": [
        {"job_id": str(51 + i), "kind": kind} for i, kind in enumerate(kinds)]}))
    assert watch.latest_job(run) == latest


def test_a_local_launch_that_died_ends_the_watch(tmp_path):
    run = fake_run(tmp_path)
    gone = dead_pid()
    manifest = {"submissions": [{"job_id": "51", "kind": "train"},
                                {"job_id": None, "local": True, "pid": gone, "host": os.uname().nodename,
                                 "started": "2026-01-01T12:00:00+00:00"}]}
    (run.dir / "manifest.json").write_text(json.dumps(manifest))
    out = Console(file=io.StringIO(), width=160, color_system=None)
    assert watch.latest_job(run) == watch.LOCAL
    assert watch.watch(run, interval=0.01, console=out) == 1
    text = out.file.getvalue()
    assert "job local  DIED" in text and "job local ended: DIED, exit code 1" in text and "nodes" not in text, text


def test_a_local_launch_is_running_until_its_launcher_records_the_outcome():
    """The trainer exits before the launcher writes its exit code: in between the launch is still
    running, not DIED (a watcher polling then would report a finished run as dead)."""
    gone = dead_pid()

    def state(**recorded) -> tuple[str, Optional[int]]:
        launch = Launch(local=True, host=socket.gethostname(), started="2026-01-01T12:00:00+00:00", **recorded)
        got = lifecycle.launch_state(launch, [], process=lifecycle.observe_local(launch))
        return got.state, got.exit_code

    assert state(pid=os.getpid(), trainer_pid=gone) == ("RUNNING", None)
    # a killed launcher leaves its trainer going
    assert state(pid=gone, trainer_pid=os.getpid()) == ("RUNNING", None)
    assert state(pid=gone, trainer_pid=gone) == ("DIED", None)
    assert state(pid=os.getpid(), trainer_pid=gone, exit=0) == ("COMPLETED", 0)


def test_logs_f_of_a_local_launch_that_died_exits_1(tmp_path, capsys):
    """`slipway logs RUN -f` ends with the launch's exit code, as for a Slurm job; one that died
    without recording it is a failure, not a success. Printing the log alone succeeds."""
    from jobs.cli.logs import show_logs

    run = fake_run(tmp_path)
    gone = dead_pid()
    (run.dir / "logs").mkdir()
    (run.dir / "logs" / "local-1.out").write_text("step 1/90 loss 5.0\n")
    launch = {"job_id": None, "local": True, "pid": gone, "trainer_pid": gone, "host": socket.gethostname(),
              "started": "2026-01-01T12:00:00+00:00", "log": "logs/local-1.out"}
    (run.dir / "manifest.json").write_text(json.dumps({"submissions": [launch]}))
    assert show_logs(run, None, follow=True, stream="out") == 1
    assert show_logs(run, None, follow=False, stream="out") == 0
    (run.dir / "manifest.json").write_text(json.dumps({"submissions": [{**launch, "exit": 3}]}))
    assert show_logs(run, None, follow=True, stream="out") == 3
    assert "step 1/90 loss 5.0" in capsys.readouterr().out


@pytest.mark.slow
def test_watch_follows_a_local_run_to_its_end(project):
    """`make local` in one terminal, `slipway watch` in another: the real launch on this machine."""
    from test_e2e import TINY, slipway, wait_for

    launch = subprocess.Popen([PY, "-m", "jobs", "local", "tiny_cpu", "--run-name", "here", *TINY, "train.steps=40"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics = project / "runs" / "here" / "metrics.jsonl"
        wait_for(lambda: metrics.is_file() and metrics.stat().st_size > 0, 120, "the local run's first step", poll=0.2)
        frame = slipway("watch", "here", "--once")
        assert frame.returncode == 0, frame.stderr
        assert re.search(r"run here  job local  RUNNING  on \S+  elapsed \d\d:\d\d:\d\d", frame.stdout), frame.stdout
        assert re.search(r"step \d+/40\s+loss \d+\.\d+", frame.stdout), frame.stdout
        assert "job local start on this machine" in frame.stdout and "nodes" not in frame.stdout, frame.stdout
        watched = slipway("watch", "here", "--interval", "0.5", timeout=180)
        assert launch.wait(timeout=60) == 0
    finally:
        launch.kill()
    assert watched.returncode == 0, (watched.stdout, watched.stderr)
    assert "job local ended: COMPLETED, exit code 0" in watched.stdout and "step 40/40" in watched.stdout, \
        watched.stdout
    status = slipway("status", "here")
    assert re.search(r"local\s+│\s+COMPLETED\s+│\s+0\s+│\s+\d\d:\d\d:\d\d", status.stdout), status.stdout


# ------------------------------------------------------------------ in a real terminal


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", "-L", f"slipway-test-{os.getpid()}", *args], capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.slurm
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (Debian package tmux)")
def test_watch_in_a_terminal_against_a_running_job(project, slurm_env):
    from test_e2e import TINY, slipway, wait_for

    r = slipway("submit", "tiny_cpu", "--parsable", "--run-name", "watched", "--nodes", "2", "--dp", "4", *TINY,
                "train.steps=60")
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().splitlines()[-1]
    command = f"cd {shlex.quote(str(project))} && {shlex.quote(PY)} -m jobs watch watched --interval 1; " \
              "echo WATCH-EXIT=$?"
    tmux("new-session", "-d", "-s", "w", "-x", "150", "-y", "50", "-e", f"SLURM_CONF={slurm_env['SLURM_CONF']}",
         "-e", f"SLIPWAY_PROJECT={project}")
    try:
        tmux("send-keys", "-t", "w", "-l", command)
        tmux("send-keys", "-t", "w", "Enter")

        def live() -> str:
            text = tmux("capture-pane", "-p", "-t", "w")
            m = re.search(r"step (\d+)/60 .*loss \d+\.\d+ +[\d,]+ tokens/s", text)
            return text if "RUNNING" in text and m and int(m.group(1)) > 0 and "preflight ok on node[1-2]" in text \
                else ""

        running = wait_for(live, 150, "the view of the running job", poll=0.5)
        assert f"job {job_id}  RUNNING  on node[1-2]" in running, running
        assert re.search(r"last step \d+s ago", running), running
        for node in ("node1", "node2"):  # every node's heartbeat, fresh
            assert re.search(rf"{node}\s+│\s+\d+s ago", running), running
        def exited() -> str:
            text = tmux("capture-pane", "-p", "-t", "w")
            return text if re.search(r"WATCH-EXIT=\d", text) else ""  # the typed command has WATCH-EXIT=$?

        ended = wait_for(exited, 150, "watch to exit", poll=0.5)
        assert "WATCH-EXIT=0" in ended and f"job {job_id} ended: COMPLETED, exit code 0" in ended, ended
        assert "step 60/60" in ended and f"job {job_id} end exit 0" in ended, ended
    finally:
        subprocess.run(["tmux", "-L", f"slipway-test-{os.getpid()}", "kill-server"], capture_output=True)
