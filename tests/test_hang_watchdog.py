"""The hang watchdog (trainer/watchdog.py): in one process with a stand-in exit, and for real
in a 2-process gloo world where one rank stops making progress mid-run."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from common.errors import ConfigError
from common.rundir import HANG_EXIT, HangLine
from common.schema import from_dict
from trainer.config import TrainSection
from trainer.watchdog import HARD_EXIT_SECONDS, SLOW_CHECKPOINT_EXIT, HangWatchdog, collective_timeout
from trainer_helpers import ROOT, clean_env, tiny_config, write_run


class Exits:
    """A stand-in for os._exit: records the code and wakes the test."""

    def __init__(self):
        self.codes: list[int] = []
        self.event = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.event.set()


def watchdog(tmp_path: Path, timeout: float, first: float, exits: Exits, rank: int = 0,
             checkpoint: float = 1800) -> HangWatchdog:
    return HangWatchdog(TrainSection(hang_timeout=timeout, hang_timeout_first_step=first,
                                     checkpoint_timeout=checkpoint), tmp_path, rank,
                        dump_window_s=0.1, hard_exit_s=20, exit=exits)


def stuck_in_a_collective(event: threading.Event) -> None:
    event.wait(20)  # the test's stand-in for a rank waiting on a peer that never comes


def test_a_stalled_loop_dumps_every_thread_and_exits_4(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPWAY_JOB_TAG", "77")
    monkeypatch.setenv("SLURMD_NODENAME", "nodeX")
    exits = Exits()
    dog = watchdog(tmp_path, timeout=0.5, first=5, exits=exits, rank=3).start(10)
    for step in (11, 12, 13):
        time.sleep(0.2)
        dog.step_done(step)
    stalled_at = time.monotonic()
    stuck_in_a_collective(exits.event)
    waited = time.monotonic() - stalled_at
    # Not before the limit (a loaded machine only makes it later; the stand-in's 20 s wait bounds it).
    assert exits.codes == [HANG_EXIT] and waited >= 0.5, (exits.codes, waited)
    dump = tmp_path / "hangs" / "77-nodeX-3.txt"
    assert dump.is_file()
    text = dump.read_text()
    first = HangLine.parse(text.splitlines()[0])
    # The first line is what the batch script reads: rank, host, step, idle seconds, the limit.
    assert (first.rank, first.host, first.step, first.limit_s, first.on_time) == (3, "nodeX", 13, 0.5, True)
    assert "(limit 0.5 s: train.hang_timeout)" in text
    assert "in stuck_in_a_collective" in text and "in test_a_stalled_loop_dumps_every_thread_and_exits_4" in text
    assert "Current thread" in text  # the watchdog's own thread is in the dump too, marked


def test_steps_that_keep_coming_are_never_a_hang(tmp_path):
    exits = Exits()
    dog = watchdog(tmp_path, timeout=1.0, first=1.0, exits=exits).start(0)
    for step in range(1, 13):  # 12 x 0.25 s = 3 s, three times the limit
        time.sleep(0.25)
        dog.step_done(step)
    dog.stop()
    assert exits.codes == []
    assert not (tmp_path / "hangs").exists()
    progress = __import__("json").loads((tmp_path / "progress.json").read_text())
    assert progress["step"] == 12 and progress["hang_timeout"] == 1.0  # rank 0 keeps it, for `slipway watch`


def test_the_first_step_gets_its_own_allowance(tmp_path):
    exits = Exits()
    dog = watchdog(tmp_path, timeout=0.4, first=2.0, exits=exits).start(5)
    time.sleep(0.9)  # a slow first step (compilation): past hang_timeout, well within the first-step limit
    assert exits.codes == []
    dog.step_done(6)
    assert exits.event.wait(3) and exits.codes == [HANG_EXIT]
    assert "(limit 0.4 s: train.hang_timeout)" in next((tmp_path / "hangs").glob("*.txt")).read_text()

    exits = Exits()
    dog = watchdog(tmp_path / "b", timeout=0.4, first=0.8, exits=exits).start(0)
    assert exits.event.wait(3)
    assert "after step 0 (limit 0.8 s: train.hang_timeout_first_step)" in next((tmp_path / "b" / "hangs").glob("*.txt")).read_text()


def test_zero_turns_it_off(tmp_path):
    exits = Exits()
    dog = watchdog(tmp_path, timeout=0, first=0, exits=exits).start(0)
    time.sleep(0.3)
    dog.stop()
    assert exits.codes == [] and not dog.enabled and not (tmp_path / "progress.json").exists()


class Marker:
    """A device's completion marker (a CUDA event's query) the test moves by hand."""

    def __init__(self):
        self.reached = False

    def query(self) -> bool:
        return self.reached


def test_a_step_counts_once_the_device_reached_it_not_once_queued(tmp_path, monkeypatch):
    """The host queues steps 1-6 and runs on; the device finishes 1-3 and stops: the hang is
    after step 3, noticed hang_timeout after step 3 was done, not after step 6 was queued."""
    monkeypatch.setenv("SLIPWAY_JOB_TAG", "5")
    monkeypatch.setenv("SLURMD_NODENAME", "nodeM")
    exits = Exits()
    dog = watchdog(tmp_path, timeout=1.5, first=10, exits=exits).start(0)
    markers = {step: Marker() for step in range(1, 7)}
    for step, marker in markers.items():
        dog.step_queued(step, marker)  # the host runs ahead: all queued at once
    for step in (1, 2, 3):
        time.sleep(0.4)
        markers[step].reached = True  # the device gets there
    done = time.monotonic()
    assert exits.event.wait(10) and exits.codes == [HANG_EXIT]
    assert time.monotonic() - done >= 1.5 - 0.6  # within the marker poll of step 3's completion + the limit
    first = HangLine.read(tmp_path / "hangs" / "5-nodeM-0.txt")
    assert first.step == 3, first
    # On the CPU a step is done when queued (no marker); a sync step says so whatever the markers say.
    exits = Exits()
    (tmp_path / "b").mkdir()
    dog = watchdog(tmp_path / "b", timeout=3.0, first=10, exits=exits).start(0)
    dog.step_queued(1, None)
    dog.step_queued(2, Marker())
    time.sleep(0.6)
    dog.step_done(2)  # the host waited for the device at a sync step
    dog.step_queued(3, Marker())
    time.sleep(0.6)
    dog.stop()
    assert exits.codes == []
    assert __import__("json").loads((tmp_path / "b" / "progress.json").read_text())["step"] == 2
    # Off (hang_timeout 0), no thread runs: nothing may pile up a marker a step for the whole run.
    off = watchdog(tmp_path / "b", timeout=0, first=0, exits=Exits()).start(0)
    for step in range(1, 1001):
        off.step_queued(step, Marker())
    assert not off._queued


def test_on_cuda_the_thread_asks_the_markers_on_its_ranks_device(tmp_path, monkeypatch):
    """A new thread starts on CUDA device 0: asking a step's event there would open a context on
    GPU 0 from every rank. The thread takes the device the rank set (the trainer's main thread,
    at start) before its first query. No GPU here: torch.cuda's three calls are stood in for."""
    import torch

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, d)))

    class Asked(Marker):
        def query(self) -> bool:
            calls.append((threading.current_thread().name, "query"))
            return True

    dog = watchdog(tmp_path, timeout=5, first=5, exits=Exits(), rank=1).start(0)
    dog.step_queued(1, Asked())
    deadline = time.monotonic() + 10
    while ("slipway-hang-watchdog", "query") not in calls and time.monotonic() < deadline:
        time.sleep(0.05)
    dog.stop()
    assert calls[:2] == [("slipway-hang-watchdog", 3), ("slipway-hang-watchdog", "query")], calls


def test_checkpoint_work_pauses_the_step_limit_under_a_bound_of_its_own(tmp_path, monkeypatch):
    """A save three times hang_timeout is no hang; the step limit starts anew after it; a save
    past train.checkpoint_timeout ends the run as a slow checkpoint (exit 1, one event from rank
    0, the stacks in the log), never as a hang (no dump in hangs/)."""
    monkeypatch.setenv("SLIPWAY_JOB_TAG", "6")
    monkeypatch.delenv("SLIPWAY_EVENT_JOB", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "6")
    exits = Exits()
    dog = watchdog(tmp_path, timeout=2.0, first=2.0, exits=exits, checkpoint=30).start(0)
    dog.step_done(1)
    with dog.paused("the checkpoint save of step 1"):
        with dog.paused("the checkpoint save in flight"):  # nested: the outer one decides
            time.sleep(4.0)
        time.sleep(1.0)
    time.sleep(0.5)  # well within the limit after the save
    dog.step_done(2)
    time.sleep(0.5)
    dog.stop()
    assert exits.codes == [] and not (tmp_path / "hangs").exists()

    exits = Exits()
    run = tmp_path / "slow"
    run.mkdir()
    dog = watchdog(run, timeout=0.5, first=0.5, exits=exits, checkpoint=1.0).start(0)
    t0 = time.monotonic()
    with dog.paused("the checkpoint save of step 4"):
        assert exits.event.wait(10)
    assert exits.codes == [SLOW_CHECKPOINT_EXIT] and time.monotonic() - t0 >= 1.0
    assert not (run / "hangs").exists()
    (event,) = (run / "events.log").read_text().splitlines()
    assert " job 6 slow checkpoint: the checkpoint save of step 4 has taken 1 s, over " \
           "train.checkpoint_timeout (1 s), on rank 0 " in event and "raise train.checkpoint_timeout" in event
    # Rank 1 says it in its log only: one event for the run.
    exits = Exits()
    other = tmp_path / "slow1"
    other.mkdir()
    dog = watchdog(other, timeout=0.5, first=0.5, exits=exits, rank=1, checkpoint=0.5).start(0)
    with dog.paused("the checkpoint load"):
        assert exits.event.wait(10)
    assert exits.codes == [SLOW_CHECKPOINT_EXIT] and not (other / "events.log").exists()


@pytest.mark.parametrize("train, field, words", [
    ({"hang_timeout": -1}, "train.hang_timeout", "must be >= 0 seconds"),
    ({"hang_timeout": 60, "hang_timeout_first_step": 30}, "train.hang_timeout_first_step",
     "must be >= hang_timeout (60), got 30"),
    ({"checkpoint_timeout": -5}, "train.checkpoint_timeout", "must be >= 0 seconds"),
])
def test_bad_limits_are_config_errors(train, field, words):
    with pytest.raises(ConfigError) as exc:
        from_dict(TrainSection, train, "train")
    assert exc.value.field == field and words in str(exc.value)


# A run of the real trainer in which global rank 1 stops making progress in its data loader
# before its third step (it sleeps, the interpreter stays free): rank 0 waits for it in the
# step's collective. Both watchdogs must fire.
STALL = """
import os, sys, time
sys.path.insert(0, {tests!r})
import trainer_helpers
from trainer.train import main

class Stalling(trainer_helpers.SyntheticSampler):
    def next_batch(self):
        if os.environ["RANK"] == "1" and self.consumed == 2 * {accum}:
            time.sleep(600)  # stuck: in the dump as this function
        return super().next_batch()

def data(cfg, run_dir, dp_rank, dp_size):
    make = lambda seed: Stalling(seed, cfg.model.vocab_size, cfg.train.micro_batch_size, cfg.data.seq_len,
                                 dp_rank, dp_size)
    return make(1), None, cfg.model.vocab_size

sys.exit(main(["--config", sys.argv[1]], data=data))
"""


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_stuck_rank_ends_the_run_with_every_live_rank_dump(tmp_path):
    cfg = tiny_config(parallel={"dp": 2}, train={"steps": 50, "hang_timeout": 3, "hang_timeout_first_step": 60})
    config = write_run(tmp_path, "stall", cfg)
    script = tmp_path / "stall.py"
    script.write_text(STALL.format(tests=str(ROOT / "tests"), accum=cfg["train"]["grad_accum_steps"]))
    env = clean_env(SLIPWAY_JOB_TAG="9", SLURMD_NODENAME="nodeA")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), str(config)], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "exitcode  : 4" in proc.stderr or "exitcode: 4" in proc.stderr.replace("  ", " "), proc.stderr[-4000:]
    hangs = tmp_path / "stall" / "hangs"
    dumps = {p.name: p.read_text() for p in hangs.glob("*.txt")}
    assert sorted(dumps) == ["9-nodeA-0.txt", "9-nodeA-1.txt"], (sorted(dumps), proc.stderr[-3000:])
    stuck, waiting = dumps["9-nodeA-1.txt"], dumps["9-nodeA-0.txt"]
    # Both name the last step every rank completed (rank 1 stalls reading ahead for step 3).
    steps = {HangLine.parse(text.splitlines()[0]).step for text in dumps.values()}
    assert len(steps) == 1 and steps.pop() >= 1, [text.splitlines()[0] for text in dumps.values()]
    assert "in next_batch" in stuck  # where rank 1 is stuck
    # Rank 0 waits in the step's collective: its flight recorder names it, the whole trace beside.
    assert "flight recorder:" in waiting and "gloo:" in waiting, waiting[:1500]
    assert (hangs / "9-nodeA-0.fr.pkl").stat().st_size > 0
    # Every process group the trainer made (the default one, the mesh's, the stop vote's) waits
    # longer than the watchdog's limits, first step included: the watchdog ends the hang, with
    # its dumps and exit 4, never a collective timeout error.
    expected = collective_timeout(from_dict(TrainSection, cfg["train"], "train")).total_seconds()
    for name, text in dumps.items():
        line = next(ln for ln in text.splitlines() if ln.startswith("process group timeouts"))
        groups = line.split(": ", 1)[1].split("; ")
        assert len(groups) >= 2 and {float(g.split()[-1]) for g in groups} == {expected}, (name, line)
    assert expected > 60 + HARD_EXIT_SECONDS
    assert "timed out" not in proc.stderr.lower() and "Timeout" not in proc.stderr, proc.stderr[-3000:]


# The real trainer in one process, its checkpoint writes slowed where the test says (DCP's
# FileSystemWriter.write_data, for the checkpoint of step 4) and, with STUCK_AFTER, a device
# that stops after that step: the completion marker of each later step never says done, while
# the host runs on (what CUDA's asynchronous queue does when a kernel or a collective hangs).
SLOW = """
import os, sys, time
sys.path.insert(0, {tests!r})
import trainer_helpers
import trainer.train
from torch.distributed.checkpoint import FileSystemWriter

original = FileSystemWriter.write_data

def slow(self, plan, planner):
    if "step-000004" in str(self.path):
        time.sleep({save_s})
    return original(self, plan, planner)

FileSystemWriter.write_data = slow

class Marker:
    def __init__(self, reached):
        self.reached = reached

    def query(self):
        return self.reached

queued = [0]

def marker(device):
    queued[0] += 1
    return Marker(queued[0] <= {stuck_after})

if {stuck_after} >= 0:
    trainer.train.step_marker = marker
sys.exit(trainer_helpers.main(sys.argv[1:]))
"""


def run_slow(tmp_path: Path, name: str, *, save_s: float, stuck_after: int = -1, interval: int = 2,
             **train) -> tuple:
    # hang_timeout 10 s: a step of this model takes well under a second, on a loaded machine too.
    cfg = tiny_config(train={"steps": 6, "hang_timeout": 10, "hang_timeout_first_step": 60, **train},
                      checkpoint={"interval": interval}, logging={"interval": 100})
    config = write_run(tmp_path, name, cfg)
    script = tmp_path / f"{name}.py"
    script.write_text(SLOW.format(tests=str(ROOT / "tests"), save_s=save_s, stuck_after=stuck_after))
    env = clean_env(SLIPWAY_JOB_TAG="8", SLURMD_NODENAME="nodeS", SLIPWAY_EVENT_JOB="8",
                    SLIPWAY_TEST_BATCH_DELAY="0.05")
    proc = subprocess.run([sys.executable, str(script), str(config)], capture_output=True, text=True, timeout=180,
                          env=env, cwd=ROOT)
    return proc, config.parent


@pytest.mark.slow
def test_a_save_longer_than_the_hang_limit_is_no_hang_and_one_past_its_bound_is_a_slow_checkpoint(tmp_path):
    proc, run = run_slow(tmp_path, "slow", save_s=25)  # two and a half times hang_timeout
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (run / "hangs").exists()
    assert (run / "checkpoints" / "step-000004" / "COMPLETE").is_file()

    proc, run = run_slow(tmp_path, "stuck", save_s=300, checkpoint_timeout=2)
    assert proc.returncode == SLOW_CHECKPOINT_EXIT, proc.stderr[-3000:]
    assert not (run / "hangs").exists()
    events = (run / "events.log").read_text().splitlines()
    assert len(events) == 1 and " job 8 slow checkpoint: the checkpoint save of step 4 has taken " in events[0]
    assert "slow checkpoint: the checkpoint save of step 4" in proc.stderr and "in slow" in proc.stderr  # the stacks
    assert [p.name for p in (run / "checkpoints").iterdir() if not p.name.startswith(".")] == ["step-000002"]


@pytest.mark.slow
def test_a_hang_is_after_the_last_step_the_device_finished_not_the_last_queued(tmp_path):
    """The device stops after step 2 while the host queues on (no checkpoint or log due: no sync
    step to wait at): the watchdog fires hang_timeout after step 2, and says so."""
    proc, run = run_slow(tmp_path, "device", save_s=0, stuck_after=2, steps=400, interval=1000)
    assert proc.returncode == HANG_EXIT, proc.stderr[-3000:]
    (dump,) = (run / "hangs").glob("*.txt")
    first = HangLine.read(dump)
    assert first.step == 2, first
    progress = __import__("json").loads((run / "progress.json").read_text())
    assert progress["step"] == 2
