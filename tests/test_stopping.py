"""Stopping and trying (issue 30): Ctrl-C of `slipway local` saves and says so in a few lines,
torch's and torchrun's shutdown noise stays in the log, and a run tried on this machine fits
its memory or is refused before any process starts, naming what would fit.

Through the command line with real processes: `slipway local` of tiny_cpu's layout (2 ranks,
gloo), SIGINT sent to the launcher's process group as a terminal sends it."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import default_signals
from jobs.launcher import Noise

PY = sys.executable

# A small model at one step a sync step (logging.interval=1): a stop lands on the next step.
SMALL = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "data.seq_len=64", "model.max_position_embeddings=64", "train.micro_batch_size=4",
         "train.eval_interval=0", "train.warmup_steps=2", "logging.interval=1", "checkpoint.interval=1000"]


def slipway(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "jobs", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


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


# ---------------------------------------------------------------- Ctrl-C of slipway local


@pytest.mark.slow
@pytest.mark.multiproc
def test_ctrl_c_saves_at_the_step_says_so_in_two_lines_and_the_pasted_command_resumes_exactly(project):
    steps = "train.steps=200"
    reference = slipway("local", "tiny_cpu", "--run-name", "ref", *SMALL, steps)
    assert reference.returncode == 0, reference.stdout[-3000:]
    assert "Traceback" not in reference.stdout + reference.stderr

    run_dir = project / "runs" / "cc"
    # A session of its own, like a terminal's foreground job: the signal goes to its whole group.
    launcher = subprocess.Popen([PY, "-m", "jobs", "local", "tiny_cpu", "--run-name", "cc", *SMALL, steps],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                preexec_fn=default_signals)
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").is_file() and len(losses(run_dir)) >= 3, 240, "three steps")
        os.killpg(launcher.pid, signal.SIGINT)  # Ctrl-C
        out, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
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

    # The command the report names, pasted: it resumes at the saved step and ends where the
    # uninterrupted run did, with the same losses.
    again = subprocess.run(pasted(said[1]), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:]
    assert f"resuming run cc" in again.stdout
    got, want = losses(run_dir), losses(project / "runs" / "ref")
    assert sorted(got) == sorted(want) == list(range(1, 201))
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=1e-6), (step, got[step], want[step])


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_second_ctrl_c_stops_at_once_unsaved(project):
    run_dir = project / "runs" / "twice"
    # No sync step for a long while: the first Ctrl-C's save waits, the second does not.
    launcher = subprocess.Popen([PY, "-m", "jobs", "local", "tiny_cpu", "--run-name", "twice", *SMALL,
                                 "logging.interval=100000", "train.steps=100000"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                preexec_fn=default_signals)
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").is_file() and losses(run_dir), 240, "the first step")
        os.killpg(launcher.pid, signal.SIGINT)
        time.sleep(2)
        t0 = time.monotonic()
        os.killpg(launcher.pid, signal.SIGINT)
        out, _ = launcher.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 130, out[-3000:]
    assert took < 30, took  # the kill and the sweep; generous for a loaded machine, far below the 90 s grace
    said = after_ctrl_c(out)
    assert len(said) == 2 and "before its first checkpoint" in said[1], said
    assert "Traceback" not in out
    assert checkpoints(run_dir) == []
