"""One launch of a run at a time, and every end of a local launch told and cleaned up: parallel
submissions against stand-in Slurm commands, two `slipway local` of one run, SIGTERM and SIGHUP
to the launcher alone, a hang, and a resubmission after the config schema gained a key."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from test_e2e import TINY, wait_for
from conftest import default_signals, squeue_answering, stand_in
from trainer_helpers import ROOT

PY = sys.executable


def slipway(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "jobs", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def refused(r: subprocess.CompletedProcess, *words: str) -> str:
    """The one line of a refusal (exit 2) naming run.name."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("slipway: error: run.name: "), \
        (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def slurm(tmp_path: Path) -> dict[str, str]:
    """sbatch that records each call and hands out ids from 501; squeue that reports a job
    sbatch gave out as PENDING (so a second submission sees it queued) until `ended` holds it."""
    bin_dir, calls = tmp_path / "slurm-bin", tmp_path / "slurm-calls"
    stand_in(bin_dir, "sbatch", 'echo "sbatch $*" >> "$SLURM_CALLS"\n'
                                'echo $(( $(grep -c "^sbatch" "$SLURM_CALLS") + 500 ))\n')
    stand_in(bin_dir, "scontrol", '[ "$1" = ping ] && echo "Slurmctld(primary) at stand-in is UP"\n')
    stand_in(bin_dir, "squeue", squeue_answering(
        '$(grep -qx "$id" "$SLURM_CALLS.ended" 2>/dev/null && echo COMPLETED || echo PENDING)'))
    calls.touch()
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_CALLS": str(calls)}


def sbatch_calls(slurm: dict[str, str]) -> list[str]:
    return Path(slurm["SLURM_CALLS"]).read_text().splitlines()


@pytest.mark.slow
def test_parallel_submissions_of_one_run_queue_one_job(project, slurm):
    with ThreadPoolExecutor(max_workers=20) as pool:
        results = list(pool.map(lambda _: slipway("submit", "tiny_cpu", "--run-name", "same", env=slurm), range(20)))
    ok = [r for r in results if r.returncode == 0]
    assert len(ok) == 1, [(r.returncode, r.stderr) for r in results]
    assert len(sbatch_calls(slurm)) == 1, sbatch_calls(slurm)
    manifest = json.loads((project / "runs" / "same" / "manifest.json").read_text())
    assert [s["job_id"] for s in manifest["submissions"]] == ["501"]
    for r in results:
        if r.returncode != 0:  # the job queued, or the submission that queues it still at work
            line = refused(r)
            assert "has a job queued or running (501 (PENDING))" in line or "is being launched by `slipway submit" \
                in line, line
    # Once the job has ended, a resubmission resumes the run; the manifest keeps both.
    Path(slurm["SLURM_CALLS"] + ".ended").write_text("501\n")
    assert slipway("submit", "tiny_cpu", "--run-name", "same", env=slurm).returncode == 0
    manifest = json.loads((project / "runs" / "same" / "manifest.json").read_text())
    assert [s["job_id"] for s in manifest["submissions"]] == ["501", "502"]
    assert stat_mode(project / "runs" / ".same.lock") & 0o002 == 0


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


@pytest.mark.slow
def test_a_config_key_added_since_resumes_the_run(project, slurm):
    """A run made by an older slipway has no line for a key added since (at its default): the
    same config resubmitted resumes it. A changed value, or a file that no longer reads, is refused."""
    assert slipway("submit", "tiny_cpu", "--run-name", "old", env=slurm).returncode == 0
    Path(slurm["SLURM_CALLS"] + ".ended").write_text("501\n")
    config = project / "runs" / "old" / "config.yaml"
    older = [line for line in config.read_text().splitlines(True) if not line.startswith("  hang_timeout_first_step:")]
    assert len(older) == len(config.read_text().splitlines()) - 1
    config.write_text("".join(older))
    r = slipway("submit", "tiny_cpu", "--run-name", "old", env=slurm)
    assert r.returncode == 0 and "resubmitted" in r.stdout, r.stderr
    assert "hang_timeout_first_step" in config.read_text()  # rewritten in today's words, the old one in history/
    assert any("hang_timeout_first_step" not in p.read_text() for p in (config.parent / "history").glob("config-*"))
    Path(slurm["SLURM_CALLS"] + ".ended").write_text("501\n502\n")
    refused(slipway("submit", "tiny_cpu", "--run-name", "old", "train.steps=7", env=slurm), "a different config")
    config.write_text(config.read_text() + "retired_section:\n  x: 1\n")
    refused(slipway("submit", "tiny_cpu", "--run-name", "old", env=slurm), "a config this slipway no longer reads",
            "retired_section")


# ------------------------------------------------------------------ local launches


def session_members(sid: int) -> list[str]:
    """The command lines of the processes of session `sid` (from /proc: field 6 of stat)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = text.rsplit(")", 1)[1].split()
        if int(fields[3]) == sid:  # after `pid (comm)`: state ppid pgrp session
            found.append(f"{stat.parent.name} {cmdline}")
    return found


def sessions_of_run(run_dir: Path) -> set[int]:
    """Every session whose processes have this run's config on their command line."""
    config = str(run_dir / "config.yaml")
    sids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if config in (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                sids.add(int(stat.read_text().rsplit(")", 1)[1].split()[3]))
        except (OSError, ValueError):
            continue
    return sids


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_the_launcher_stops_the_run_and_leaves_nothing(project, slurm, sig):
    run_dir = project / "runs" / "here"
    # Its own session, as a terminal gives it: the signal goes to the launcher alone.
    launcher = subprocess.Popen([PY, "-m", "jobs", "local", "tiny_cpu", "--run-name", "here", *TINY,
                                 "train.steps=400"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, preexec_fn=default_signals)
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_for(lambda: metrics.is_file() and metrics.stat().st_size > 0, 150, "the first step", poll=0.2)
        # torchrun in a session of its own (as a Slurm job step), each rank in another (torchrun's doing)
        trainers = sessions_of_run(run_dir) - {launcher.pid}
        assert len(trainers) == 3, trainers

        # While it trains, a second launch of the run is refused at once (not after the wait a
        # submission gets, which says "after 30 s"), naming the holder.
        line = refused(slipway("local", "tiny_cpu", "--run-name", "here", *TINY, "train.steps=400"), "is training",
                       f"pid {launcher.pid}", "`slipway local tiny_cpu", "since 20")
        assert "after 30 s" not in line, line
        refused(slipway("submit", "tiny_cpu", "--run-name", "here", *TINY, "train.steps=400", env=slurm),
                "is training", f"pid {launcher.pid}")
        assert sbatch_calls(slurm) == []

        os.kill(launcher.pid, sig)  # the launcher only, not its group
        out, _ = launcher.communicate(timeout=150)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    name = signal.Signals(sig).name
    assert launcher.returncode == 128 + sig, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"terminated by {name} at step ") and " and saved it: `" in last, last
    assert "resumes from there" in last and "Traceback" not in out, last
    for sid in (launcher.pid, *trainers):
        assert session_members(sid) == [], f"left running: {session_members(sid)}"
    assert sessions_of_run(run_dir) == set()
    status = slipway("status", "here")
    assert "RUNNING" not in status.stdout and str(128 + sig) in status.stdout, status.stdout
    events = (run_dir / "events.log").read_text()
    assert f"job local terminated by {name} at step" in events and f"job local end signal {name}" in events
    entry = json.loads((run_dir / "manifest.json").read_text())["submissions"][-1]
    assert entry["exit"] == 128 + sig and entry["signal"] == name and entry["ended"]
    # Stopped, the run is free again: the lock went with the launch.
    r = slipway("submit", "tiny_cpu", "--run-name", "here", *TINY, "train.steps=400", env=slurm)
    assert r.returncode == 0 and "resubmitted" in r.stdout and len(sbatch_calls(slurm)) == 1, r.stderr


# The trainer with global rank 1 stuck in its data loader before its third step, as in
# tests/test_hang_watchdog.py: rank 0 waits for it in the step's collective.
STALL = """
import os, sys, time
sys.path.insert(0, {tests!r})
import trainer_helpers
from trainer.train import main

class Stalling(trainer_helpers.SyntheticSampler):
    def next_batch(self):
        if os.environ["RANK"] == "1" and self.consumed == 2 * {accum}:
            time.sleep(600)
        return super().next_batch()

def data(cfg, run_dir, dp_rank, dp_size):
    make = lambda seed: Stalling(seed, cfg.model.vocab_size, cfg.train.micro_batch_size, cfg.data.seq_len,
                                 dp_rank, dp_size)
    return make(1), None, cfg.model.vocab_size

sys.exit(main(sys.argv[1:], data=data))
"""


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_hang_ends_the_local_launch_saying_so(project):
    script = project / "stall.py"
    script.write_text(STALL.format(tests=str(ROOT / "tests"), accum=1))
    r = slipway("local", "tiny_cpu", "--run-name", "stuck", *TINY, "train.grad_accum_steps=1", "train.steps=50",
                f"train.script={script}", "train.hang_timeout=3", "train.hang_timeout_first_step=60", timeout=240)
    assert r.returncode == 4, (r.stdout[-3000:], r.stderr[-2000:])
    last = r.stdout.strip().splitlines()[-1]
    run_dir = project / "runs" / "stuck"
    dumps = sorted((run_dir / "hangs").glob("local-*.txt"))
    assert len(dumps) == 2, dumps
    tag = dumps[0].name.rsplit("-", 2)[0]
    assert last.startswith("hung: no step completed for 3 s after step "), last
    assert last.endswith(f"stack dumps from 2 of 2 ranks in {run_dir / 'hangs'}/{tag}-*.txt"), last
    assert "training failed" not in r.stdout
    events = (run_dir / "events.log").read_text()
    assert f"hangs/{tag}-*.txt" in events and "job local end exit 4" in events
    assert json.loads((run_dir / "manifest.json").read_text())["submissions"][-1]["exit"] == 4
