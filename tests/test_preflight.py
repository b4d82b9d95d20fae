"""The preflight's all-reduce inside the training step (trainer/preflight.py AllReduceGate): the
batch script asks for it through PREFLIGHT_ENV; rank 0 records a pass in events.log, a failing
rank reports why among the step's exit reports and exits PREFLIGHT_EXIT before any training.
What the batch script does with either is tests/test_hang_script.py; the real thing on the
local Slurm is tests/test_hang_slurm.py."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from trainer.preflight import AllReduceGate
from kernel.rundir import PREFLIGHT_ENV, PREFLIGHT_EXIT, PREFLIGHT_FAILED_FILE, read_events
from trainer_helpers import ROOT, clean_env, read_metrics, tiny_config, write_run

TESTS = Path(__file__).resolve().parent


def gate_env(tmp_path: Path, value: str = "1 60") -> dict[str, str]:
    (tmp_path / "exits").mkdir(exist_ok=True)
    return {PREFLIGHT_ENV: value, "SLIPWAY_RUN_DIR": str(tmp_path), "SLIPWAY_EXITS": str(tmp_path / "exits"),
            "SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "node[1-2]", "RANK": "1"}


def test_no_gate_unless_the_batch_script_asks():
    assert AllReduceGate.from_environ({}) is None
    gate = AllReduceGate.from_environ({PREFLIGHT_ENV: "64 300"})
    assert (gate.megabytes, gate.timeout_s) == (64.0, 300.0)
    with pytest.raises(ValueError, match=PREFLIGHT_ENV):
        AllReduceGate.from_environ({PREFLIGHT_ENV: "64"})


def test_a_failing_rank_reports_once_and_exits(tmp_path, capsys):
    exits = []
    gate = AllReduceGate(1, 60, gate_env(tmp_path), exit=exits.append)
    gate.fail("rank 1 on node2: RuntimeError: Connection closed by peer")
    gate.fail("a later rank's report")  # the first failing rank's report is kept
    assert exits == [PREFLIGHT_EXIT, PREFLIGHT_EXIT]
    report = (tmp_path / "exits" / PREFLIGHT_FAILED_FILE).read_text()
    assert report == "rank 1 on node2: RuntimeError: Connection closed by peer\n"
    assert "slipway-preflight-allreduce fail: rank 1 on node2" in capsys.readouterr().err


def test_no_result_within_the_bound_is_a_failure(tmp_path):
    exits = []
    AllReduceGate(1, 0.2, gate_env(tmp_path), exit=exits.append).arm()  # the group never forms
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.02)
    assert exits == [PREFLIGHT_EXIT]
    report = (tmp_path / "exits" / PREFLIGHT_FAILED_FILE).read_text()
    assert report.startswith("the all-reduce across every rank gave no result within 0.2 s (rank 1 on ")


def test_a_passed_check_is_disarmed(tmp_path, monkeypatch):
    import trainer.preflight as preflight

    exits = []
    monkeypatch.setattr(preflight, "sum_across_ranks", lambda mb, iters, device: (True, "stand-in"))
    gate = AllReduceGate(1, 0.3, {**gate_env(tmp_path), "RANK": "0"}, exit=exits.append).arm()
    gate.check(None)
    time.sleep(0.6)
    assert exits == [] and not (tmp_path / "exits" / PREFLIGHT_FAILED_FILE).exists()
    assert [(e.job, e.text) for e in read_events(tmp_path)] == [("41", "preflight ok on node[1-2]: stand-in")]


def _torchrun(tmp_path: Path, driver: str, config: Path, value: str = "1 60"):
    import subprocess

    script = tmp_path / "driver.py"
    script.write_text(driver)
    env = clean_env(**gate_env(config.parent, value))
    env.pop("RANK")
    env["PYTHONPATH"] = f"{ROOT}:{TESTS}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), str(config)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)


@pytest.mark.multiproc
def test_the_training_step_runs_the_all_reduce_first_and_records_it(tmp_path):
    config = write_run(tmp_path, "r1", tiny_config(parallel={"dp": 2}, train={"steps": 2}))
    proc = _torchrun(tmp_path, "import sys\nfrom trainer_helpers import main\nsys.exit(main())\n", config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [(e.job, e.text) for e in read_events(config.parent)]
    assert len(events) == 1 and events[0][0] == "41", events
    assert events[0][1].startswith("preflight ok on node[1-2]: all-reduce of 1 MiB over 2 ranks on 1 node(s) (gloo): ")
    assert [r["step"] for r in read_metrics(config.parent)] == [1, 2]


@pytest.mark.multiproc
def test_a_peer_lost_during_the_all_reduce_fails_it_before_any_training(tmp_path):
    """Rank 1 vanishes once the group is up: rank 0's collective fails (or outlives the bound),
    it reports and exits PREFLIGHT_EXIT; nothing is trained."""
    driver = ("import os, sys\nimport trainer.preflight as preflight\n"
              "if os.environ['RANK'] == '1':\n"
              "    preflight.sum_across_ranks = lambda *a: os._exit(0)\n"
              "from trainer_helpers import main\nsys.exit(main())\n")
    config = write_run(tmp_path, "r1", tiny_config(parallel={"dp": 2}, train={"steps": 2}))
    proc = _torchrun(tmp_path, driver, config, value="1 20")
    assert proc.returncode != 0
    report = (config.parent / "exits" / PREFLIGHT_FAILED_FILE).read_text()
    assert report.startswith(("rank 0 on ", "the all-reduce across every rank gave no result within 20 s")), report
    assert f"exitcode  : {PREFLIGHT_EXIT}" in proc.stderr or f"exitcode : {PREFLIGHT_EXIT}" in proc.stderr, \
        proc.stderr[-3000:]
    assert not (config.parent / "metrics.jsonl").exists()
    assert not [e for e in read_events(config.parent) if e.text.startswith("preflight ok")]


@pytest.mark.multiproc
def test_the_all_reduce_step_of_a_train_script_runs_in_a_group_of_its_own(tmp_path):
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "trainer.preflight", "allreduce", "--megabytes", "1", "--timeout", "60"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=clean_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("slipway-preflight-allreduce ok: all-reduce of 1 MiB over 2 ranks on 1 node(s) "
                                  "(gloo): "), proc.stdout
