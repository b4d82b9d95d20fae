"""Stopping and trying (issue 30): Ctrl-C of `slipway local` saves and says so in a few lines,
torch's and torchrun's shutdown noise stays in the log, and a run tried on this machine fits
its memory or is refused before any process starts, naming what would fit.

Through the command line with real processes: `slipway local` of tiny_cpu's layout (2 ranks,
gloo), SIGINT sent to the launcher's process group as a terminal sends it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from conftest import default_signals
from jobs.supervisor import STOP_GRACE_SECONDS, Noise

PY = sys.executable

# A small model at one step a sync step (logging.interval=1): a stop lands on the next step.
SMALL = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "data.seq_len=64", "model.max_position_embeddings=64", "train.micro_batch_size=4",
         "train.eval_interval=0", "train.warmup_steps=2", "logging.interval=1", "checkpoint.interval=1000"]


def slipway(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "jobs", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@contextlib.contextmanager
def launched(*args: str) -> Iterator[subprocess.Popen]:
    """`slipway ARGS` in a session of its own, like a terminal's foreground job (a Ctrl-C goes to
    its whole group), with the signals' defaults; killed with its group if the test ends first."""
    launcher = subprocess.Popen([PY, "-m", "jobs", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True, preexec_fn=default_signals)
    try:
        yield launcher
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl (a resumed run's later lines win)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "train":
            out[record["step"]] = record["loss"]
    return out


def checkpoints(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*/COMPLETE"))


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def pasted(line: str) -> list[str]:
    """The command a report line quotes in backticks, as a shell would split it when pasted."""
    return shlex.split(line.split("`")[1])


def after_ctrl_c(out: str) -> list[str]:
    """The lines from the launcher's answer to the first Ctrl-C to the end."""
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("Ctrl-C: "))
    return lines[first:]


# ---------------------------------------------------------------- what reaches the terminal

TORCHRUN_REPORT = """\
W1125 16:25:57.555000 30359 torch/distributed/elastic/agent/server/api.py:753] Received 2 death signal, shutting down workers
[rank1]: Traceback (most recent call last):
[rank1]:   File "/x/torch/autograd/graph.py", line 979, in _engine_run_backward
[rank1]:     return Variable._execution_engine.run_backward(
[rank1]: 
16:25:57 [rank0] INFO trainer.checkpoint: saved checkpoint /runs/cc/checkpoints/step-000130
[rank1]: During handling of the above exception, another exception occurred:
[rank1]: 
[rank1]: Traceback (most recent call last):
[rank1]:   File "<frozen runpy>", line 198, in _run_module_as_main
[rank1]: KeyboardInterrupt
Traceback (most recent call last):
  File "/x/torch/distributed/run.py", line 1032, in <module>
    main()
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
trainer FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 75 (pid: 14472)
============================================================
[W1125 16:30:03.123456789 socket.cpp:464] [c10d] recvValue failed: Connection reset by peer
[rank0]:[W1125 16:30:04.000000000 ProcessGroupGloo.cpp:1100] Warning: destroy_process_group() was not called
Exception raised from recvBytes at /pytorch/torch/csrc/distributed/c10d/Utils.hpp:678 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f in /x/libc10.so)
frame #1: <unknown function> + 0x5f6 (0x7f in /x/libtorch_cpu.so)
terminate called after throwing an instance of 'c10::DistNetworkError'
  what():  recvValue failed
step 131/400 loss 5.1 lr 3.00e-03
"""


def test_the_terminal_gets_the_trainers_lines_and_not_torchs_shutdown_noise():
    noise = Noise()
    shown = [line for line in TORCHRUN_REPORT.splitlines(keepends=True) if noise.shown(line)]
    assert shown == ["16:25:57 [rank0] INFO trainer.checkpoint: saved checkpoint /runs/cc/checkpoints/step-000130\n",
                     "step 131/400 loss 5.1 lr 3.00e-03\n"]
    assert noise.exception == ""  # a deliberate stop's exceptions are no failure's reason


def test_a_crashs_reason_is_its_last_exception_line():
    noise = Noise()
    for line in ["[rank1]: Traceback (most recent call last):\n", '[rank1]:   File "t.py", line 3, in f\n',
                 "some output of the user's own script\n", "[rank1]: RuntimeError: boom\n", "after\n"]:
        noise.shown(line)
    assert noise.exception == "rank 1: RuntimeError: boom"
    assert Noise().shown("some output of the user's own script\n")



@pytest.mark.parametrize("how", ["record", "other job", "damaged", "fifo", "directory", "missing"])
def test_a_silent_launch_reads_rank_0s_progress_without_waiting_on_whatever_stands_there(tmp_path, how):
    """The heartbeat of `slipway local`/`run` reads progress.json from the output's thread: a FIFO
    there (or anything not a record of this launch) is no progress, and never a wait."""
    import threading

    from jobs.supervisor import Heartbeat

    path = tmp_path / "progress.json"
    if how in ("record", "other job"):
        path.write_text(json.dumps({"job": "local-1" if how == "record" else "77", "step": 12, "unix": 1700000000.5}))
    elif how == "damaged":
        path.write_text('{"job": "local-1", "step": "twelve"')
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "directory":
        path.mkdir()
    heartbeat = Heartbeat(tmp_path, "local-1", 2, steps=20, checkpoints=tmp_path / "checkpoints")
    seen = []
    reader = threading.Thread(target=lambda: seen.append(heartbeat.progress()), daemon=True)
    reader.start()
    reader.join(30)
    assert not reader.is_alive(), "the heartbeat waits on progress.json"
    assert seen == [(12, 1700000000.5) if how == "record" else None]

# ---------------------------------------------------------------- Ctrl-C of slipway local


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_local_sweep_goes_past_a_failed_point_and_ctrl_c_stops_it_saved_with_130(project):
    """docs/runs.md: a failed point does not stop the others; Ctrl-C stops them all, its point saved."""
    runs, second = project / "runs", project / "runs" / "f-lr1e-3"
    with launched("sweep", "tiny_cpu", "--name", "f", *SMALL, "train.steps=2000", "train.max_nonfinite_steps=1",
                  "train.lr=[1e9, 1e-3, 3e-3]", "--local") as launcher:  # 1e9: not finite by its second step
        wait_for(lambda: (second / "metrics.jsonl").is_file() and len(losses(second)) >= 3, 240, "the second point")
        os.killpg(launcher.pid, signal.SIGINT)  # Ctrl-C
        out, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 130, out[-3000:]
    assert "sweep f: 0 of 3 point(s) ended 0; f-lr1e9 exit 1, f-lr1e-3 exit 130" in " ".join(out.split()), out[-3000:]
    assert "had a non-finite loss or gradient norm" in out  # the first point's own error, and then the others ran
    assert (runs / "f-lr1e9" / "events.log").read_text().endswith("job local end exit 1\n")
    assert checkpoints(second) == [max(losses(second))] and "INTERRUPTED" in slipway("status", "f-lr1e-3").stdout
    assert "point 3/3" not in out and not (runs / "f-lr3e-3").exists()


@pytest.mark.slow
@pytest.mark.multiproc
def test_ctrl_c_saves_at_the_step_says_so_in_two_lines_and_the_pasted_command_resumes_exactly(project):
    steps = "train.steps=200"
    reference = slipway("local", "tiny_cpu", "--run-name", "ref", *SMALL, steps)
    assert reference.returncode == 0, reference.stdout[-3000:]
    assert "Traceback" not in reference.stdout + reference.stderr

    run_dir = project / "runs" / "cc"
    with launched("local", "tiny_cpu", "--run-name", "cc", *SMALL, steps) as launcher:
        wait_for(lambda: (run_dir / "metrics.jsonl").is_file() and len(losses(run_dir)) >= 3, 240, "three steps")
        os.killpg(launcher.pid, signal.SIGINT)  # Ctrl-C
        out, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 130, out[-3000:]
    said = after_ctrl_c(out)
    assert len(said) == 2, said  # the answer to Ctrl-C, and the end
    assert "Traceback" not in out and "FAILED" not in out and "ChildFailedError" not in out, out[-3000:]
    saved = checkpoints(run_dir)
    stopped = max(losses(run_dir))
    assert saved == [stopped] and 3 <= stopped < 200, (saved, stopped)
    assert said[1].startswith(f"interrupted (Ctrl-C) at step {stopped} and saved it: `"), said[1]
    assert "resumes from there; log: " in said[1]
    assert not (run_dir / "stop-requested").exists()
    assert "INTERRUPTED" in slipway("status", "cc").stdout
    # The log keeps what the terminal was spared: the ranks' exits as torchrun reported them.
    log = next((run_dir / "logs").glob("local-*.out")).read_text()
    assert "exitcode" in log and "stopping after step" in log
    # ... below a line of slipway's that says what they are, and ending as the terminal did.
    lines = log.splitlines()
    note = next(i for i, line in enumerate(lines) if line.startswith("slipway: SIGINT: the ranks were asked to save"))
    assert "is this stop, not a failure" in lines[note] and note < next(i for i, x in enumerate(lines) if "exitcode" in x)
    assert lines[-1] == f"slipway: {said[1]}", lines[-3:]

    # The command the report names, pasted: it resumes at the saved step and ends where the
    # uninterrupted run did, with the same losses.
    again = subprocess.run(pasted(said[1]), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "resuming run cc" in again.stdout
    got, want = losses(run_dir), losses(project / "runs" / "ref")
    assert sorted(got) == sorted(want) == list(range(1, 201))
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=1e-6), (step, got[step], want[step])


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_second_ctrl_c_stops_at_once_unsaved(project):
    run_dir = project / "runs" / "twice"
    # No sync step for a long while: the first Ctrl-C's save waits, the second does not.
    with launched("local", "tiny_cpu", "--run-name", "twice", *SMALL, "logging.interval=100000",
                  "train.steps=100000", "--yes") as launcher:  # --yes: longer than a try, knowingly
        wait_for(lambda: (run_dir / "metrics.jsonl").is_file() and losses(run_dir), 240, "the first step")
        os.killpg(launcher.pid, signal.SIGINT)
        time.sleep(2)
        t0 = time.monotonic()
        os.killpg(launcher.pid, signal.SIGINT)
        out, _ = launcher.communicate(timeout=STOP_GRACE_SECONDS - 5)
        took = time.monotonic() - t0
    assert launcher.returncode == 130, out[-3000:]
    # Without the second Ctrl-C the first one's save would wait for a sync step that never comes,
    # until its grace: any end before that is the second one's doing, however loaded the machine.
    assert took < STOP_GRACE_SECONDS - 5, took
    said = after_ctrl_c(out)
    assert len(said) == 2 and "before its first checkpoint" in said[1], said
    assert "Traceback" not in out
    assert checkpoints(run_dir) == []


# ---------------------------------------------------------------- a run tried here fits or says why


def tiny_cpu(*overrides: str):
    from jobs.config import load_config

    return load_config(Path(__file__).resolve().parent.parent / "configs" / "tiny_cpu.yaml", list(overrides))


def test_the_batch_that_fits_keeps_the_layout_and_the_global_batch():
    from common.layouts import PROCESS_BASE_BYTES, fitting_batch, process_memory

    cfg = tiny_cpu("train.micro_batch_size=48", "train.grad_accum_steps=2")
    need = process_memory(cfg)
    assert process_memory(cfg, 24) < need and process_memory(cfg, 48, 64) < need
    assert fitting_batch(cfg, need) == (48, 2, 128)
    micro, accum, seq = fitting_batch(cfg, process_memory(cfg, 20))
    assert (micro, accum, seq) == (16, 6, 128)  # the largest divisor of the 96 sequences a rank takes a step
    # Not even micro batch 1 fits: the sequences shorten, as many of them a step.
    assert fitting_batch(cfg, process_memory(cfg, 1, 64)) == (1, 96, 64)
    assert fitting_batch(cfg, PROCESS_BASE_BYTES) is None


@pytest.mark.slow
def test_a_try_that_cannot_fit_here_is_refused_before_any_process_with_the_batch_that_would(project):
    from jobs.local_checks import available_memory
    from common.layouts import process_memory

    available = available_memory()
    if available is None:
        pytest.skip("this machine's free memory cannot be read")
    micro = 8
    # Twice what is free now (one rank alone would not fit): the other tests' processes may free
    # memory between this reading and the command's own.
    while process_memory(tiny_cpu(f"train.micro_batch_size={micro}")) <= available:
        micro *= 2
    # A few steps: the batch that fits is also a try of minutes here (tests/test_first_hour.py has the
    # command that fits in time as well).
    r = slipway("local", "tiny_cpu", "--run-name", "big", f"train.micro_batch_size={micro}", "train.steps=3")
    assert r.returncode == 2 and "new run" not in r.stdout and r.stderr.count("\n") == 1, (r.stdout, r.stderr)
    line = r.stderr.strip()
    assert line.startswith("slipway: error: train.micro_batch_size: 2 processes of about "), line
    assert "(common/layouts.py's arithmetic) need " in line and "; `slipway local tiny_cpu " in line, line
    command = pasted(line)
    assert f"train.micro_batch_size={micro}" not in command and "--micro-batch-size" in command, command
    fit = int(command[command.index("--micro-batch-size") + 1])
    assert fit * int(command[command.index("--grad-accum-steps") + 1]) == micro  # the same global batch
    assert "keeps the layout and the global batch" in line
    assert not (project / "runs").exists()  # no process, no run directory


class MemoryCgroup:
    """A memory cgroup of its own under this process's (cgroup v1 or v2), removed at the end; the
    test skips where none can be made (not root, no memory controller)."""

    def __init__(self, name: str) -> None:
        self.dir: Path | None = None
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "memory":
                base, self.limit_file = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"
            elif controllers == "":
                base, self.limit_file = Path("/sys/fs/cgroup"), "memory.max"
            else:
                continue
            group = base / path.lstrip("/") / f"{name}-{os.getpid()}"
            try:
                group.mkdir()
            except OSError:
                continue
            if (group / self.limit_file).exists():
                self.dir = group
                return
            group.rmdir()
        pytest.skip("no memory cgroup can be made here (needs root and a memory controller)")

    def limit(self, nbytes: int) -> None:
        (self.dir / self.limit_file).write_text(str(nbytes))

    def add(self, pid: int) -> None:
        (self.dir / "cgroup.procs").write_text(str(pid))

    def enter(self) -> None:  # a preexec_fn: the child and all it starts live in the group
        self.add(os.getpid())

    def remove(self) -> None:
        deadline = time.monotonic() + 30
        while (self.dir / "cgroup.procs").read_text().split() and time.monotonic() < deadline:
            time.sleep(0.2)
        self.dir.rmdir()


@pytest.fixture
def cgroup():
    group = MemoryCgroup("slipway-test")
    yield group
    group.remove()


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_refusals_pasted_batch_trains_in_the_memory_a_cgroup_leaves(project, cgroup):
    """Under a 3 GB memory cgroup (a Slurm allocation's, a container's), the machine's free memory
    is what the cgroup leaves: the check reads it, and the batch it suggests trains there."""
    cgroup.limit(3 * 10**9)
    args = ["local", "tiny_cpu", "--run-name", "fit", *SMALL, "train.micro_batch_size=2048", "train.steps=2"]
    r = subprocess.run([PY, "-m", "jobs", *args], capture_output=True, text=True, timeout=120,
                       preexec_fn=cgroup.enter)
    assert r.returncode == 2 and " GB free: " in r.stderr and "; `slipway local " in r.stderr, (r.stdout, r.stderr)
    free = float(r.stderr.split(" GB free")[0].rsplit(" ", 1)[1])
    assert free <= 3.0, r.stderr
    again = subprocess.run(pasted(r.stderr), capture_output=True, text=True, timeout=600, preexec_fn=cgroup.enter)
    assert again.returncode == 0, again.stdout[-3000:]
    assert sorted(losses(project / "runs" / "fit")) == [1, 2]


def rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of the trainer's rank `rank` of the run (its config on the command line, RANK in its environment)."""
    config = str(run_dir / "config.yaml").encode()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if b"trainer" in (proc / "cmdline").read_bytes() and config in (proc / "cmdline").read_bytes() and \
                    f"RANK={rank}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                return int(proc.name)
        except OSError:
            continue
    return None


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_rank_the_out_of_memory_killer_ends_is_named_with_the_batch_that_fits(project, cgroup):
    """The arithmetic said it fits, the kernel said no: rank 1, moved into a memory cgroup too small
    for its next step, is killed by the out-of-memory killer, and the end says so with the hint."""
    run_dir = project / "runs" / "oom"
    with launched("local", "tiny_cpu", "--run-name", "oom", *SMALL, "train.micro_batch_size=64", "data.seq_len=128",
                  "model.max_position_embeddings=128", "train.steps=100000", "--yes") as launcher:
        wait_for(lambda: (run_dir / "metrics.jsonl").is_file() and losses(run_dir), 240, "the first step")
        cgroup.limit(64 * 2**20)  # what it allocates from here on: less than one step's activations
        cgroup.add(rank_pid(run_dir, 1))
        out, _ = launcher.communicate(timeout=240)
    assert launcher.returncode == 137, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("rank 1 was killed by the out-of-memory killer (SIGKILL) at step "), last
    assert ": this machine ran out of memory; `slipway local tiny_cpu " in last, last
    assert "` keeps the layout and the global batch (~" in last and "; log: " in last, last
    command = pasted(last)
    micro = int(command[command.index("--micro-batch-size") + 1])
    assert micro < 64 and micro * int(command[command.index("--grad-accum-steps") + 1]) == 64, command
    assert "Traceback" not in out
    events = (run_dir / "events.log").read_text()
    assert "job local rank 1 was killed by the out-of-memory killer (SIGKILL)" in events, events


# The stand-in srun of tests/test_hang_script.py, but the training step goes through the step's
# real task wrapper (the `bash -c` of the srun line) around $FAKE/train.sh, as task 0 on node1.
SRUN_THROUGH_THE_WRAPPER = """#!/bin/bash
case " $* " in
  *" slipway-verify "*) while [ "${1#--}" != "$1" ]; do shift; done
    for n in $(cat "$FAKE/nodes"); do SLURMD_NODENAME=$n "$@"; done; exit 0 ;;
  *" trainer.preflight node "*) exec bash "$FAKE/node.sh" ;;
  *" --overlap "*) exit 0 ;;  # the node helper, container removals and sweeps: nothing here
esac
while [ "$#" -gt 0 ] && [ "$1" != -c ]; do shift; done
SLURM_PROCID=0 SLURMD_NODENAME=node1 exec bash -c "$2" slipway-task bash "$FAKE/train.sh"
"""


def test_a_job_step_the_out_of_memory_killer_ended_is_named_in_events_with_the_smaller_batch(tmp_path, cgroup):
    import test_hang_script as hang_script

    job = hang_script.Job(tmp_path, "train.micro_batch_size=8", "slurm.preflight=false")
    (job.fake / "bin" / "srun").write_text(SRUN_THROUGH_THE_WRAPPER)
    cgroup.limit(100 * 2**20)
    # The training step: a process the kernel's out-of-memory killer ends, in a cgroup of its own.
    job.script("train.sh", f"echo $$ > {shlex.quote(str(cgroup.dir / 'cgroup.procs'))}\n"
                           f"exec {shlex.quote(PY)} -c 'x = bytearray(400 * 2**20)'")
    assert job.run() == 137, job.out
    events = job.events()
    assert ("out of memory: the out-of-memory killer ended a process of the training step on node1 (step exit "
            "137): submit again with --micro-batch-size 4 --grad-accum-steps 2 --force (the same global batch in "
            "smaller micro batches)") in events, events
    assert events[-1] == "end exit 137"


def test_a_job_step_that_fails_otherwise_says_nothing_of_memory(tmp_path):
    import test_hang_script as hang_script

    job = hang_script.Job(tmp_path, "slurm.preflight=false")
    (job.fake / "bin" / "srun").write_text(SRUN_THROUGH_THE_WRAPPER)
    job.script("train.sh", "exit 3")
    assert job.run() == 3, job.out
    assert not [e for e in job.events() if "memory" in e], job.events()


@pytest.mark.slow
@pytest.mark.multiproc
def test_ctrl_c_during_a_slow_step_says_what_it_waits_for_and_what_a_forced_stop_lost(project):
    """A rank stuck in a step (stopped here) never reaches the save the first Ctrl-C asks for: the
    first line states the grace (launch.stop_grace sets it), a line every 10 s says what the stop
    waits for, and the forced stop says how long it waited, what was lost (the last checkpoint is
    the one kept) and the command that resumes from there."""
    from test_first_hour import launch_reading, ranks_of

    run_dir = project / "runs" / "stuck"
    proc = launch_reading("local", "tiny_cpu", "--run-name", "stuck", *SMALL, "checkpoint.interval=5",
                          "train.steps=100000", "launch.stop_grace=25", "--yes")
    try:
        wait_for(lambda: checkpoints(run_dir) and len(losses(run_dir)) >= 7, 240, "a checkpoint and two steps more")
        stuck = ranks_of(run_dir)[1]
        os.kill(stuck, signal.SIGSTOP)  # rank 1 in a step that does not end
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    said = after_ctrl_c("".join(proc.lines))
    assert said[0] == ("Ctrl-C: saving a checkpoint at the next step the ranks agree on, then stopping; a forced stop "
                       "(unsaved) in 25s (launch.stop_grace); Ctrl-C again stops at once, unsaved"), said
    waits = [x for x in said if "since the stop was asked, waiting for " in x]  # told once a second: 10 s, 20 s
    assert len(waits) == 2 and re.fullmatch(r"1[01]s since the stop was asked, waiting for the ranks to finish step "
                                            r"\d+ \(step \d+ done \d+s ago\) and save; a forced stop \(unsaved\) in "
                                            r"1[45]s", waits[0]) and re.search(r" in [45]s$", waits[1]), waits
    kept = checkpoints(run_dir)[-1]
    assert 25 <= took < 90 and proc.returncode == 130, (took, said)
    assert said[-1].startswith("interrupted (Ctrl-C) at step ") and (
        f": stopped after 25s, unsaved: the last checkpoint is step {kept}; `slipway local tiny_cpu ") in said[-1], said
    resumed = subprocess.run(pasted(said[-1]) + ["--dry-run"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and "dry run: stuck (resumes) in " in resumed.stdout, resumed.stdout
