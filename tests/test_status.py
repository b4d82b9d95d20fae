"""Status at scale (jobs/cli/status.py, watch.py, lifecycle.ask_slurm, jobs/slurm `jobs_info`):
through the CLI against a stand-in Slurm that counts its calls, a mixed set of runs (ended,
running, queued, requeued, forgotten by slurmctld, unknown to Slurm, a local launch, a damaged
manifest) costs one squeue and one sacct per command, with the job ids batched, and none for a
launch whose end events.log settles; what each run shows is what Slurm and events.log say."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from plumbum import local

from jobs.config import dump_config, load_config
from jobs.runs import manifest as manifests
from jobs.runs.manifest import Launch, Manifest
from jobs.cli.status import LISTING
from jobs.slurm import sacct_argv, squeue_argv
from common.events import append_event
from slurm_standin import StandInSlurm

PY = sys.executable
T0 = "2026-01-01T12:00:00+00:00"
START = "start on node[1-2] (restart 0), failure retries 0/2, time-limit requeues 0/20"
# run: (its launches' job ids, the events of the latest, Slurm's record of the latest: (state, exit, where))
RUNS = {
    "done": (["11"], [START, "end exit 0"], ("COMPLETED", "0:0", "acct")),
    "failed": (["12"], [START, "end exit 3"], ("FAILED", "3:0", "acct")),
    "cancelled": (["13"], [START, "cancelled by slipway cancel", "end exit 140"], ("CANCELLED", "0:9", "ctld")),
    "running": (["14"], [START], ("RUNNING", "0:0", "ctld")),
    "queued": (["15"], [], ("PENDING", "0:0", "ctld")),
    "requeued": (["9", "16"], [START, "retry 1/2 (hang): requeueing without node2", "end exit 0"],
                 ("PENDING", "0:0", "ctld")),
    "timeout": (["17"], [START, "cancelled (SIGTERM)", "end exit 143"], ("TIMEOUT", "0:15", "acct")),
    "gone": (["18"], [START], None),
}
ASKED = ["14", "15", "16", "17", "18"]  # the launches events.log does not settle
SHOWN = {"done": ("COMPLETED", "0"), "failed": ("FAILED", "3"), "cancelled": ("CANCELLED", "140"),
         "running": ("RUNNING", ""), "queued": ("PENDING", ""), "requeued": ("PENDING", ""),
         "timeout": ("TIMEOUT", "143"), "gone": ("UNKNOWN", ""), "here": ("COMPLETED", "0")}


def slipway(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "jobs", *args], capture_output=True, text=True, timeout=120,
                          env={**env, "COLUMNS": "300"})


CONFIG = dump_config(load_config(str(Path(__file__).resolve().parent.parent / "configs" / "tiny_cpu.yaml")))


def make_run(root: Path, name: str, launches: list[Launch], texts: list[str]) -> Path:
    run = root / name
    (run / "logs").mkdir(parents=True)
    (run / "config.yaml").write_text(CONFIG)
    manifests.write(run / "manifest.json", Manifest(run=name, created=T0, submissions=launches))
    for text in texts:
        append_event(run, launches[-1].id, text, T0)
    return run


@pytest.fixture
def mixed(project, tmp_path) -> tuple[StandInSlurm, dict, Path]:
    """The runs of RUNS under project/runs, Slurm's records of their jobs, a local launch that
    ended (`here`), and `bad`, whose manifest is damaged."""
    slurm = StandInSlurm(tmp_path / "slurm")
    root = project / "runs"
    for name, (jobs, texts, record) in RUNS.items():
        make_run(root, name, [Launch(job_id=j, submitted=T0, steps=50) for j in jobs], texts)
        for job in jobs[:-1]:  # an earlier launch of the run, long ended
            append_event(root / name, job, START, T0)
            append_event(root / name, job, "end exit 0", T0)
        if record:
            state, code, where = record
            slurm.job(jobs[-1], state, code, where=where, reason="BeginTime" if state == "PENDING" else "None")
    here = Launch(local=True, started=T0, ended=T0, exit=0, pid=1, host=socket.gethostname(), log="logs/l.out")
    make_run(root, "here", [here], ["start on this machine", "end exit 0"])
    (root / "here" / "logs" / "l.out").write_text("trained here\n")
    (root / "done" / "metrics.jsonl").write_text(
        "".join(json.dumps({"kind": "train", "step": s, "loss": 5 - s / 10}) + "\n" for s in range(1, 21)))
    (root / "bad").mkdir()
    (root / "bad" / "manifest.json").write_text('{"submissions": [{"job_id": "19"')
    return slurm, slurm.env(), root


def rows(out: str) -> dict[str, list[str]]:
    """The listing's rows by run: (jobs, latest job, state, exit, progress, last event), cut where
    the heads start."""
    head, *lines = out.splitlines()[1:]
    starts = [head.index(h) for h in LISTING] + [None]
    cells = [[line[a:b].strip() for a, b in zip(starts, starts[1:])] for line in lines]
    return {row[0]: row[1:] for row in cells}


def test_status_asks_slurm_once_for_every_run_it_shows_and_not_for_ended_ones(mixed):
    slurm, env, root = mixed
    r = slipway("status", env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "bad/manifest.json: damaged" in r.stderr
    shown = rows(r.stdout)
    for name, (state, code) in SHOWN.items():
        assert shown[name][2] == state and (shown[name][3] if code else "") == code, (name, shown[name])
    assert shown["bad"][2] == "DAMAGED" and shown["done"][4] == "step 20/50, loss 3.000"
    assert shown["requeued"][:2] == ["2", "16"]
    # One squeue for what events.log leaves open, one sacct for what slurmctld forgot of those.
    assert slurm.state_calls() == [" ".join(squeue_argv(ASKED)), " ".join(sacct_argv(["17", "18"]))]


@pytest.mark.slow
def test_status_of_a_run_asks_only_about_its_open_launches(mixed):
    slurm, env, _ = mixed
    r = slipway("status", "requeued", env=env)
    assert r.returncode == 0, r.stderr
    assert slurm.state_calls() == [" ".join(squeue_argv(["16"]))]
    assert "BeginTime" in r.stdout and "COMPLETED" in r.stdout  # job 9 from events.log, job 16 from Slurm
    slurm.reset_calls()
    for run in ("done", "failed", "cancelled", "here"):
        assert slipway("status", run, env=env).returncode == 0
        assert slipway("logs", run, "-f", env=env).returncode == int(SHOWN[run][1])
    assert slurm.calls() == []  # settled by events.log: Slurm is never asked


def test_watch_asks_once_a_frame_and_not_at_all_once_the_end_is_told(mixed):
    slurm, env, _ = mixed
    r = slipway("watch", "running", "--once", env=env)
    assert r.returncode == 0 and "RUNNING" in r.stdout, r.stderr
    assert slurm.calls() == [" ".join(squeue_argv(["14"])), "scontrol show hostnames node[1-2]"]
    slurm.reset_calls()
    r = slipway("watch", "failed", "--once", env=env)
    assert r.returncode == 0 and "job 12 ended: FAILED, exit code 3" in r.stdout, r.stdout
    assert slurm.calls() == []


def test_slurm_without_accounting_tells_what_it_told_before(mixed):
    slurm, env, _ = mixed
    slurm.accounting = False
    shown = rows(slipway("status", env=env).stdout)
    # slurmctld forgot job 17 and no accounting knows it: events.log says it ended on a SIGTERM.
    assert shown["timeout"][2:4] == ["CANCELLED", "143"] and shown["gone"][2] == "UNKNOWN"
    assert shown["running"][2] == "RUNNING" and shown["done"][2] == "COMPLETED"
    assert slurm.state_calls() == [" ".join(squeue_argv(ASKED)), " ".join(sacct_argv(["17", "18"]))]


@pytest.mark.slow
def test_a_thousand_runs_cost_the_same_two_calls(mixed):
    slurm, env, root = mixed
    for i in range(1000):
        job = str(1000 + i)
        make_run(root, f"sweep{i:04d}", [Launch(job_id=job, submitted=T0)], [START] + (["end exit 0"] if i % 2 else []))
        if i % 2 == 0:
            slurm.job(job, "RUNNING")
    r = slipway("status", env=env)
    assert r.returncode == 2 and len(rows(r.stdout)) == 1000 + len(SHOWN) + 1
    assert [c.split()[0] for c in slurm.state_calls()] == ["squeue", "sacct"]
    assert len(slurm.state_calls()[0].split("--jobs=")[1].split()[0].split(",")) == len(ASKED) + 500


def test_cancel_and_a_resubmission_ask_once_for_all_the_runs_jobs(mixed, project):
    slurm, env, root = mixed
    r = slipway("cancel", "requeued", env=env)
    assert r.returncode == 0 and "cancelled 16" in r.stdout, r.stderr
    assert slurm.state_calls()[0] == " ".join(squeue_argv(["16"]))  # job 9 ended long ago: not asked
    assert slurm.calls("scancel") == ["scancel 16"]  # pending: no batch shell to signal
    slurm.reset_calls()
    r = slipway("submit", "tiny_cpu", "--run-name", "running", env=env)
    assert r.returncode == 2 and "has a job queued or running (14 (RUNNING))" in r.stderr
    assert slurm.state_calls() == [" ".join(squeue_argv(["14"]))]


def test_logs_and_watch_take_the_job_ids_status_lists_and_only_the_runs(mixed):
    slurm, env, _ = mixed
    local = slipway("logs", "here", "--job", "local", env=env)  # the id `status here` shows
    assert local.returncode == 0 and local.stdout == "trained here\n", local.stderr
    assert slipway("watch", "here", "--job", "local", "--once", env=env).returncode == 0
    for words, ids in ((["logs", "here", "--job", "123"], "local"), (["watch", "requeued", "--job", "14", "--once"], "9, 16"),
                       (["logs", "requeued", "--job", "local"], "9, 16")):
        r = slipway(*words, env=env)
        assert r.returncode == 2 and f"--job: run {words[1]} has no job {words[3]}: its jobs are {ids} (`" in r.stderr \
            and r.stderr.endswith(f"slipway status {words[1]}` lists them)\n"), r.stderr
    assert slurm.calls() == []  # another job's state or log is never shown as the run's


def test_logs_of_a_job_whose_log_is_gone_and_watch_of_an_earlier_job(mixed):
    """A job with no log file (a deleted log, a job that never started) is one line naming the path
    and the job's state; `watch --job` of a run's earlier, ended job says how it ended, from events.log."""
    slurm, env, root = mixed
    r = slipway("logs", "done", env=env)
    assert r.returncode == 2 and r.stderr.startswith("slipway: error: RUN: no log yet at ") \
        and r.stderr.endswith(" (job 11 is COMPLETED)\n") and str(root / "done" / "logs") in r.stderr, r.stderr
    (root / "requeued" / "logs" / "9.out").write_text("the first attempt\n")
    assert slipway("logs", "requeued", "--job", "9", env=env).stdout == "the first attempt\n"
    asked = len(slurm.calls())
    r = slipway("watch", "requeued", "--job", "9", "--once", env=env)
    assert r.returncode == 0 and r.stdout.startswith("run requeued  job 9  COMPLETED\n"), r.stdout
    assert r.stdout.rstrip().endswith("job 9 ended: COMPLETED, exit code 0") and len(slurm.calls()) == asked


def test_cancel_of_a_batch_shell_that_does_not_end_scancels_it_after_the_grace_saying_so(mixed, monkeypatch, capsys):
    from jobs import runs
    from jobs.cli import status

    slurm, env, root = mixed
    (slurm.root / "deaf").touch()  # USR2 reaches a batch shell whose trap never ends the job
    monkeypatch.setattr(status, "CANCEL_GRACE_SECONDS", 7.0)
    monkeypatch.setattr(status, "CANCEL_TOLD_AFTER", 0.0)
    run = runs.find_run("running", root.parent)
    with local.env(**env):
        assert status.cancel_jobs([(run, run.launches())]) == ["14"]
    assert slurm.calls("scancel") == ["scancel --signal=USR2 --batch 14", "scancel 14"]
    err = capsys.readouterr().err.splitlines()
    assert err == ["waiting for job(s) 14 to save and record their end (scancel at 7 s)",
                   "job(s) 14 did not end in 7 s: scancel"], err


# ---------------------------------------------------------------- the listing record (jobs/runs/listing.py)

RECORD = ".listing.json"


def test_a_listing_with_its_records_reads_no_manifest_and_no_events_log(mixed, monkeypatch):
    from jobs import runs
    from jobs.cli import status
    from jobs.runs import run as run_module

    slurm, env, root = mixed
    first = slipway("status", env=env)  # reads every run and writes its record
    assert all((root / name / RECORD).is_file() for name in RUNS), sorted(p.name for p in root.iterdir())

    def unread(*args, **kwargs):
        raise AssertionError("read with a record in place")
    monkeypatch.setattr(manifests, "read", unread)
    monkeypatch.setattr(run_module, "read_events", unread)
    monkeypatch.setattr(run_module, "read_tail", unread)  # metrics.jsonl
    found, _ = runs.scan_runs(root.parent)
    with local.env(**env):  # the stand-in Slurm, for the commands plumbum runs
        listed, damaged, _ = status.listing_rows([r for r in found if r.name != "bad"])
    assert {row[0]: list(row[1:]) for row in listed} == {k: v for k, v in rows(first.stdout).items() if k != "bad"}
    assert damaged == []


def _garble(record: Path, how: str) -> None:
    if how == "binary":
        record.write_bytes(b"\x00\xff\xfe" * 100)
    elif how == "cut":
        record.write_text(record.read_text()[:40])
    elif how == "wrong types":  # of the files as they are, but not what a record holds
        data = json.loads(record.read_text())
        record.write_text(json.dumps({**data, "launches": "9", "ended": ["COMPLETED", "0", 1]}))
    elif how == "newer":
        record.write_text(json.dumps({**json.loads(record.read_text()), "format": 99, "ended": ["RUNNING", None, ""]}))
    else:  # missing, or something else in its place
        record.unlink()
        if how == "fifo":
            os.mkfifo(record)
        elif how == "directory":
            record.mkdir()
        elif how == "device":
            record.symlink_to("/dev/zero")
        elif how == "huge":
            with record.open("wb") as f:
                f.truncate(1 << 30)


def _change(root: Path, how: str) -> None:
    if how == "events":  # the running job recorded its end: events.log settles it
        append_event(root / "running", "14", "end exit 0", T0)
    elif how == "metrics":
        with (root / "done" / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"kind": "train", "step": 21, "loss": 2.5}) + "\n")
    elif how == "manifest":  # a second launch recorded
        record = manifests.read(root / "failed" / "manifest.json")
        record.submissions.append(Launch(job_id="30", submitted=T0, steps=50))
        manifests.write(root / "failed" / "manifest.json", record)


@pytest.mark.parametrize("how", ["missing", "binary", "cut", "wrong types", "newer", "fifo", "directory", "device",
                                 "huge"])
def test_a_missing_or_damaged_record_is_read_again_from_the_run_alone(mixed, how):
    slurm, env, root = mixed
    first = slipway("status", env=env)
    _garble(root / "done" / RECORD, how)
    again = slipway("status", env=env)
    assert (again.returncode, rows(again.stdout)) == (first.returncode, rows(first.stdout)), again.stdout
    assert again.stderr == first.stderr
    if how not in ("directory",):  # written anew (a directory in its place is left: a rename cannot replace it)
        assert json.loads((root / "done" / RECORD).read_text())["ended"][0] == "COMPLETED"


@pytest.mark.parametrize("launch", [{"job_id": 14}, {"local": 1}, {"pid": True}, {"steps": "50"}, {"surprise": ""}])
def test_a_record_whose_launch_holds_other_types_is_read_again(mixed, launch):
    slurm, env, root = mixed
    first = slipway("status", env=env)
    record = root / "running" / RECORD
    kept = json.loads(record.read_text())
    record.write_text(json.dumps({**kept, "launch": {**kept["launch"], **launch}}))
    again = slipway("status", env=env)
    assert (again.returncode, rows(again.stdout)) == (first.returncode, rows(first.stdout)), again.stdout
    assert json.loads(record.read_text()) == kept  # read from the run alone, and written anew


@pytest.mark.parametrize("how, run, cells", [("events", "running", ["1", "14", "COMPLETED", "0"]),
                                             ("metrics", "done", ["1", "11", "COMPLETED", "0", "step 21/50, loss 2.500"]),
                                             ("manifest", "failed", ["2", "30", "UNKNOWN", ""])])
def test_a_record_older_than_the_files_it_was_read_from_is_read_again(mixed, how, run, cells):
    slurm, env, root = mixed
    slipway("status", env=env)
    _change(root, how)
    shown = rows(slipway("status", env=env).stdout)
    assert shown[run][:len(cells)] == cells, shown[run]
