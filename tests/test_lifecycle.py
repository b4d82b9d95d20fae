"""The run-directory protocol (common/rundir.py) and the run's lifecycle (jobs/runs/lifecycle.py):
events written by either writer read back, torn and foreign lines skipped, manifest entries read
once into launches, and one table of (events, Slurm's record or the local processes) -> state."""

from __future__ import annotations

import json
import subprocess

import pytest

from jobs import runs, slurm
from jobs.runs import lifecycle
from jobs.runs.lifecycle import LocalProcess, launch_state
from jobs.runs.manifest import Launch
from jobs.runs.manifest import ManifestError, read as read_manifest
from jobs.slurm.script import EVENT_WRITER
from common.events import Event, EventKind, append_event, format_event, parse_event, read_events
from common.rundir import LOCAL_JOB, RunDir

T0 = "2026-01-01T12:00:00+00:00"
HANG = ("hang: no step completed for 20 s after step 7; stack dumps from 4 of 4 ranks in hangs/41r1-*.txt; "
        "not answering in time: 1 of the 2 ranks on node2")
START = "start on node[1-2] (restart 0), failure retries 0/2, time-limit requeues 0/20"


def events(job: str, *texts: str) -> list[Event]:
    return [Event(f"2026-01-01T12:00:{i:02d}+00:00", job, t) for i, t in enumerate(texts)]


# ------------------------------------------------------------------ the protocol


def test_an_event_round_trips_through_its_line(tmp_path):
    line = format_event("41", "retry 1/2 (hang): requeueing without node2 (excluded nodes: node2)", T0)
    assert line == f"{T0} job 41 retry 1/2 (hang): requeueing without node2 (excluded nodes: node2)\n"
    event = parse_event(line)
    assert event == Event(T0, "41", "retry 1/2 (hang): requeueing without node2 (excluded nodes: node2)")
    assert event.kind is EventKind.RETRY and event.when.year == 2026
    # one line, whatever the text holds: a line break or control character shown escaped
    append_event(tmp_path, LOCAL_JOB, "end exit 3\nstart on evil\x1b]0;title\x07")
    assert RunDir(tmp_path).events.read_text().count("\n") == 1
    [written] = read_events(tmp_path)
    assert written.text == "end exit 3\\nstart on evil\\x1b]0;title\\x07"
    assert written.kind is EventKind.END and written.exit_code == 3


def test_a_line_the_batch_scripts_bash_writer_wrote_parses(tmp_path):
    """The bash `event()` of every batch script, run by bash with a job id, and without one."""
    script = "\n".join([EVENT_WRITER, f'event "{HANG}"', 'event "end exit 4"', 'SLURM_JOB_ID="" event "prepare start"'])
    subprocess.run(["bash", "-c", script], env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "41",
                                                "EVENTS_LOG": str(RunDir(tmp_path).events)}, check=True)
    hang, end, anonymous = read_events(tmp_path)
    assert (hang.job, hang.kind, hang.hang_tag, hang.text) == ("41", EventKind.HANG, "41r1", HANG)
    assert hang.when is not None and (end.kind, end.exit_code) == (EventKind.END, 4)
    assert (anonymous.job, anonymous.kind) == ("", EventKind.PREPARE_START)


@pytest.mark.parametrize("line", [
    "", "\n", "garbage", "2026-01-01T12:0", f"{T0} job", f"{T0} job 41", f"{T0} job 41 ", "not-a-date job 41 start on x",
    "Traceback (most recent call last):", f" {T0} job 41 end exit 0", "2026-13-45T99:00:00 job 41 end exit 0",
    "\x00\x00\x00", "12 job 41 end exit 0x",
])
def test_a_torn_or_foreign_line_is_no_event(line):
    assert parse_event(line) is None


def test_readers_skip_torn_and_foreign_lines(tmp_path):
    RunDir(tmp_path).events.write_bytes(
        f"{T0} job 41 {START}\n".encode() + b"\xff\xfe binary\n" + b"somebody's note\n" +
        f"{T0} job 41 end exit 0\n".encode() + f"{T0} job 41 end ex".encode())  # the last line torn mid-write
    assert [e.text for e in read_events(tmp_path)] == [START, "end exit 0", "end ex"]
    assert read_events(tmp_path / "missing") == []


def test_event_kinds_come_from_the_texts_start():
    kinds = {
        START: EventKind.START, "start on this machine": EventKind.START, "end exit 0": EventKind.END,
        "end interrupted": EventKind.END, "prepare end exit 2": EventKind.PREPARE_END, HANG: EventKind.HANG,
        "retry 1/2 (preflight): requeueing (no node to blame)": EventKind.RETRY,
        "not retrying (hang): slurm.max_retries (2) reached": EventKind.NOT_RETRYING,
        "time-limit requeue 1/2: saved after the stop request, requeueing": EventKind.TIME_LIMIT_REQUEUE,
        "time-limit stop: saved after the stop request; slurm.requeue is off": EventKind.TIME_LIMIT_STOP,
        "not requeueing after the time-limit warning: slurm.max_requeues (1) reached": EventKind.NOT_REQUEUEING,
        "time limit warning: stop requested": EventKind.TIME_LIMIT_WARNING,
        "preflight ok on node[1-2]: 1 GB/s": EventKind.PREFLIGHT_OK,
        "preflight failed on node2: no GPU": EventKind.PREFLIGHT_FAILED,
        "node failure: node2 not responding": EventKind.NODE_FAILURE,
        "cancelled by slipway cancel": EventKind.CANCELLED, "cancelled (SIGTERM)": EventKind.CANCELLED,
        "something new": EventKind.OTHER,
    }
    assert {t: Event(T0, "41", t).kind for t in kinds} == kinds
    assert Event(T0, "local", "end interrupted").exit_code == 130
    assert Event(T0, "local", "end signal SIGTERM").exit_code == 143
    assert Event(T0, "41", "retry 1/2 exit 4").exit_code is None


# ------------------------------------------------------------------ launches from the manifest


def test_manifest_entries_are_read_once_into_launches(tmp_path):
    manifest = {"submissions": [
        {"job_id": "40", "kind": "prepare", "submitted": T0, "git": {"commit": "abc", "dirty": False},
         "image": {"image": "x.sqsh", "source": "file"}, "script_sha256": "f00"},
        {"job_id": "41", "kind": "train", "submitted": T0, "after": "40"},
        {"job_id": None, "local": True, "started": T0, "ended": T0, "pid": 12, "trainer_pid": 13, "host": "h",
         "log": "logs/local-1.out", "exit": 3},
        {"job_id": None, "local": True, "started": T0, "pid": 14, "exit": "interrupted"},
        {"job_id": None, "local": True, "started": T0, "pid": 15, "exit": None, "signal": "SIGTERM"},
    ]}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    prep, train, done, ctrl_c, term = read_manifest(tmp_path / "manifest.json").submissions
    assert (prep.kind, prep.id, prep.git["commit"], prep.image.image, prep.script_sha256) == \
        ("prepare", "40", "abc", "x.sqsh", "f00")
    assert (train.kind, train.after, train.local) == ("train", "40", False)
    assert (done.local, done.id, done.recorded_exit, done.pid, done.trainer_pid, done.log) == \
        (True, LOCAL_JOB, 3, 12, 13, "logs/local-1.out")
    assert ctrl_c.interrupted and term.signal_number == 15 and not Launch(local=True).recorded
    for junk in ("junk", {"job_id": None}, {"job_id": ["41"]}, {"job_id": True}, {"job_id": "../41"}):
        (tmp_path / "manifest.json").write_text(json.dumps({"submissions": [junk]}))
        with pytest.raises(ManifestError, match="submissions"):
            read_manifest(tmp_path / "manifest.json")


def test_a_run_reads_its_launches_and_the_events_of_each(tmp_path):
    run = runs.Run(RunDir(tmp_path / "r", tmp_path))
    run.dir.mkdir()
    (run.dir / "manifest.json").write_text(json.dumps({"submissions": [
        {"job_id": "41", "kind": "train"},
        {"job_id": None, "local": True, "started": "2026-01-01T12:01:00+00:00", "pid": 1, "exit": 0},
        {"job_id": None, "local": True, "started": "2026-01-01T12:02:00+00:00", "pid": 2, "exit": 3}]}))
    for job, stamp, text in (("41", "12:00:00", START), ("local", "12:01:00", "start on this machine"),
                             ("local", "12:01:30", "end exit 0"), ("local", "12:02:00", "start on this machine"),
                             ("local", "12:02:30", "end exit 3"), ("41", "12:03:00", "end exit 0")):
        append_event(run.dir, job, text, f"2026-01-01T{stamp}+00:00")
    slurm_job, first, second = run.launches()
    assert run.job_ids() == ["41"] and run.launch("41") == slurm_job
    assert [e.text for e in run.events_of(slurm_job)] == [START, "end exit 0"]
    assert [e.text for e in run.events_of(first)] == ["start on this machine", "end exit 0"]
    assert [e.text for e in run.events_of(second)] == ["start on this machine", "end exit 3"]
    assert run.state(slurm_job).state == "COMPLETED"
    assert (run.state(second).state, run.state(second).exit_code) == ("FAILED", 3)


# ------------------------------------------------------------------ one function to a launch's state

SLURM = Launch(job_id="41")
LOCAL = Launch(local=True, started=T0, pid=12, host="h")
GONE = LocalProcess(False, False)
ALIVE = LocalProcess(True, False)


def info(state: str, exit_code: str = "0:0", reason: str = "") -> slurm.JobInfo:
    return slurm.JobInfo("41", state, exit_code, reason)


CASES = [
    # (name, launch, event texts, Slurm's record / local processes) -> (state, exit code, reason contains)
    ("pending", SLURM, [], info("PENDING", reason="Priority"), ("PENDING", None, "Priority")),
    ("running", SLURM, [START], info("RUNNING"), ("RUNNING", None, "start on")),
    ("Slurm's own STOPPED: suspended, not ended", SLURM, [START], info("STOPPED"), ("SUSPENDED", None, "start on")),
    ("requeued after a retry", SLURM, [START, HANG, "retry 1/2 (hang): requeueing without node2", "end exit 0"],
     info("PENDING", reason="BeginTime"), ("PENDING", None, "BeginTime")),
    ("completed", SLURM, [START, "end exit 0"], info("COMPLETED"), ("COMPLETED", 0, "")),
    ("failed", SLURM, [START, "end exit 1"], info("FAILED", "1:0"), ("FAILED", 1, "end exit 1")),
    ("a code of 4 without a hang event is a failure", SLURM, [START, "end exit 4"], info("FAILED", "4:0"),
     ("FAILED", 4, "")),
    ("hung, retries used up", SLURM, [START, HANG, "not retrying (hang): slurm.max_retries (2) reached", "end exit 4"],
     info("FAILED", "4:0"), ("HUNG", 4, "hangs/41r1-*.txt")),
    ("preflight failed", SLURM, [START, "preflight failed on node2: no GPU",
                                 "not retrying (preflight): slurm.requeue is off", "end exit 5"],
     info("FAILED", "5:0"), ("PREFLIGHT_FAILED", 5, "preflight failed on node2: no GPU")),
    ("node failure", SLURM, [START, "node failure: node2 not responding, down or drained after the step failed (exit 1)",
                             "not retrying (node failure): slurm.max_retries (2) reached", "end exit 1"],
     info("FAILED", "1:0"), ("NODE_FAIL", 1, "node failure: node2")),
    ("Slurm's node failure", SLURM, [START], info("NODE_FAIL", "0:0"), ("NODE_FAIL", 0, "a node of the job failed")),
    ("time limit", SLURM, [START, "end exit 143"], info("TIMEOUT", "0:15"), ("TIMEOUT", 143, "time limit")),
    ("stopped, requeues used up", SLURM,
     [START, "time limit warning: stop requested",
      "not requeueing after the time-limit warning: slurm.max_requeues (1) reached; saved after the stop request",
      "end exit 75"], info("FAILED", "75:0"), ("STOPPED", 75, "max_requeues (1) reached")),
    ("stopped, requeue off", SLURM, [START, "time-limit stop: saved after the stop request; slurm.requeue is off",
                                     "end exit 75"], info("FAILED", "75:0"), ("STOPPED", 75, "time-limit stop")),
    ("cancelled by slipway", SLURM, [START, "cancelled by slipway cancel", "end exit 140"], info("CANCELLED", "0:15"),
     ("CANCELLED", 140, "cancelled by slipway cancel")),
    # the script recorded 143; Slurm SIGKILLed its cleanup after KillWait and says 0:9
    ("a plain scancel", SLURM, [START, "cancelled (SIGTERM)", "end exit 143"], info("CANCELLED", "0:9"),
     ("CANCELLED", 143, "SIGTERM")),
    ("the time limit's SIGTERM", SLURM, [START, "cancelled (SIGTERM)", "end exit 143"], info("TIMEOUT", "0:9"),
     ("TIMEOUT", 143, "time limit")),
    ("killed before it recorded an end", SLURM, [START], info("CANCELLED", "0:9"), ("CANCELLED", 137, "")),
    ("requeued, then cancelled while pending", SLURM, [START, "retry 1/2 (hang): requeueing", "end exit 0"],
     info("CANCELLED", "0:15"), ("CANCELLED", 143, "")),
    ("cancelled by someone else", SLURM, [START, "end exit 143"], info("CANCELLED by 1000", "0:15"),
     ("CANCELLED", 143, "by 1000")),
    ("cancelled while pending, Slurm forgot it", SLURM, ["cancelled by slipway cancel"], None,
     ("CANCELLED", None, "cancelled")),
    ("forgotten, events tell the end", SLURM, [START, "end exit 5"], None, ("FAILED", 5, "")),
    ("forgotten, events tell the completion", SLURM, [START, "end exit 0"], None, ("COMPLETED", 0, "")),
    ("forgotten mid-run", SLURM, [START], None, ("UNKNOWN", None, "start on")),
    ("forgotten after requeueing itself", SLURM, [START, "time-limit requeue 1/2: saved, requeueing", "end exit 0"],
     None, ("UNKNOWN", None, "time-limit requeue")),
    ("never heard of", SLURM, [], None, ("UNKNOWN", None, "")),
    ("only the last attempt counts", SLURM, [START, "end exit 1", "retry 1/2 (node failure): requeueing", START,
                                             "end exit 0"], info("COMPLETED"), ("COMPLETED", 0, "")),
    ("prepare job", Launch(job_id="41", kind="prepare"), ["prepare start on n1", "prepare end exit 2"],
     info("FAILED", "2:0"), ("FAILED", 2, "")),
    ("local running", LOCAL, ["start on this machine"], ALIVE, ("RUNNING", None, "")),
    ("local completed", Launch(local=True, exit=0), ["start on this machine", "end exit 0"],
     GONE, ("COMPLETED", 0, "")),
    ("local exit recorded while the launcher lives on", Launch(local=True, exit=0), [],
     ALIVE, ("COMPLETED", 0, "")),
    ("local failed", Launch(local=True, exit=3), [], GONE, ("FAILED", 3, "")),
    ("local saved and stopped", Launch(local=True, exit=75), [], GONE, ("STOPPED", 75, "")),
    ("local Ctrl-C", Launch(local=True, exit="interrupted"), ["end interrupted"], GONE,
     ("INTERRUPTED", 130, "Ctrl-C")),
    ("local SIGTERM recorded", Launch(local=True, signal=15), [], GONE,
     ("TERMINATED", 143, "SIGTERM")),
    ("local trainer killed by a signal", Launch(local=True, exit=-9), [], GONE,
     ("TERMINATED", 137, "SIGKILL")),
    ("local died without a word", LOCAL, ["start on this machine"], GONE, ("DIED", None, "recorded no end")),
    ("local launcher killed after its end event", LOCAL, ["start on this machine", "end exit 0"], GONE,
     ("COMPLETED", 0, "")),
    ("local on another machine", LOCAL, ["start on this machine"], LocalProcess(), ("UNKNOWN", None, "h")),
    ("a rank killed", SLURM, [START, "rank failed: rank 3 on node2 was killed by SIGKILL (exit 137)", "end exit 137"],
     info("FAILED", "137:0"), ("FAILED", 137, "rank 3 on node2 was killed by SIGKILL")),
    ("a rank killed, Slurm forgot the job", SLURM, [START, "rank failed: rank 3 on node2 was killed by SIGKILL (exit 137)",
                                                     "end exit 137"], None, ("FAILED", 137, "rank 3 on node2")),
    # `slipway run`: the batch script's end is the launch's; its 137 is a rank's, not a signal to the launcher
    ("slipway run, a rank killed", Launch(local=True, exit=137, allocation="40"),
     ["start on node[1-2] (restart 0)", "rank failed: rank 1 on node1 was killed by SIGKILL (exit 137)", "end exit 137"],
     GONE, ("FAILED", 137, "rank 1 on node1 was killed by SIGKILL")),
    ("slipway run, the allocation cancelled", Launch(local=True, exit=143, allocation="40"),
     ["start on node[1-2] (restart 0)", "cancelled (SIGTERM)", "end exit 143"], GONE, ("CANCELLED", 143, "SIGTERM")),
]


@pytest.mark.parametrize("launch,texts,seen,want", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_launch_state_from_its_events_and_what_slurm_or_the_process_says(launch, texts, seen, want):
    evs = events(launch.id, *texts)
    if launch.local:
        got = launch_state(launch, evs, process=seen)
    else:
        got = launch_state(launch, evs, seen)
    state, code, reason = want
    assert (got.state, got.exit_code) == (state, code), got
    assert reason in got.reason, got
    assert got.ended == (state not in ("PENDING", "RUNNING", "SUSPENDED", "UNKNOWN"))
    if state == "HUNG":
        assert got.hang_tag == "41r1"


def test_the_exit_a_command_ends_with():
    assert launch_state(LOCAL, [], process=GONE).final_exit == 1  # died: a failure, not a success
    assert launch_state(SLURM, [], info("COMPLETED", "")).final_exit == 0
    assert launch_state(SLURM, [], info("FAILED", "")).final_exit == 1


ELAPSED = [
    # (name, launch, event texts with their seconds, Slurm's record) -> elapsed
    ("ended: from its last attempt's start to its end", SLURM,
     [(0, START), (5, "retry 1/2 (hang): requeueing"), (6, "end exit 0"), (70, START), (95, "end exit 1")], None,
     "00:00:25"),
    ("cancelled by slipway cancel", SLURM, [(0, START), (42, "cancelled by slipway cancel"), (43, "end exit 140")],
     None, "00:00:43"),
    ("a failed verification", SLURM, [(0, START), (1, "verification failed: x"), (1, "end exit 2")], None, "00:00:01"),
    ("running: Slurm's figure", SLURM, [(0, START)], slurm.JobInfo("41", "RUNNING", elapsed="00:01:00"), "00:01:00"),
    ("ended without an end event: Slurm's", SLURM, [(0, START)],
     slurm.JobInfo("41", "CANCELLED", "0:9", elapsed="00:00:09"), "00:00:09"),
    ("never started, Slurm forgot it", SLURM, [(0, "cancelled by slipway cancel")], None, ""),
]


@pytest.mark.parametrize("launch,texts,seen,want", [c[1:] for c in ELAPSED], ids=[c[0] for c in ELAPSED])
def test_every_ended_job_has_its_elapsed_time(launch, texts, seen, want):
    evs = [Event(f"2026-01-01T12:{s // 60:02d}:{s % 60:02d}+00:00", "41", t) for s, t in texts]
    state = launch_state(launch, evs, seen)
    assert lifecycle.elapsed(launch, state, evs, seen) == want, state


def test_history_counts_attempts_retries_and_requeues():
    evs = events("41", START, "preflight ok on node[1-2]: 1 GB/s", HANG,
                 "retry 1/2 (hang): requeueing without node2 (excluded nodes: node2)", "end exit 0", START,
                 "time-limit requeue 1/20: saved, requeueing", "end exit 0", START) + events("42", START)
    h = lifecycle.history("41", evs)
    assert (h.attempts, h.max_retries, h.max_requeues, h.requeues, h.excluded, h.hang_tag) == (3, 2, 20, 1, "node2", "41r1")
    assert h.hang_attempt == 1  # numbered among the job's attempts, not by its id
    assert h.lines() == ["job 41: 3 attempt(s); failure retries 1/2 (hang); time-limit requeues 1/20; "
                         "preemptions 0; excluded nodes node2"]
    assert h.preflight.startswith("preflight ok")
