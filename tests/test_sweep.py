"""Sweeps (jobs/runs/sweep.py, jobs/cli/sweep.py): a set of runs as Slurm job arrays, through the
command a user types. Without Slurm: the points listed, validated and named, the arrays written
against a stand-in Slurm that counts its calls (the split over MaxArraySize, a re-run submitting
only what is not finished, the hostile cases: a damaged record, two sweeps at once, a run of a
point's name that is no point), and status, cancel, compare and plot of a sweep. On the real local
Slurm (marked `slurm`): a 2 x 2 grid trains as one array, a point killed mid-run resumes exactly
while the others finish and a re-run submits only it; the split over a small MaxArraySize and a
cancel that ends every task. The local cluster's MaxArraySize is 4 (tests/slurm_fixtures.py)."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.errors import ConfigError, one_line
from common.events import append_event
from conftest import tree
from edf.environment import SAFE_NAME
from jobs.runs import sweep as sweeps
from other_user import teammate  # noqa: F401,F811 (a fixture)
from slurm_standin import StandInSlurm

PY = sys.executable
TINY = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=2", "data.seq_len=64", "model.max_position_embeddings=64", "train.micro_batch_size=4",
        "train.warmup_steps=2", "logging.interval=1"]
GRID = ["train.lr=[3e-3, 1e-3]", "train.micro_batch_size=[4, 8]"]
NAMES = ["g-lr3e-3-micro_batch_size4", "g-lr3e-3-micro_batch_size8", "g-lr1e-3-micro_batch_size4",
         "g-lr1e-3-micro_batch_size8"]


def slipway(*args: str, env: dict | None = None, timeout: float = 240, columns: int = 200
            ) -> subprocess.CompletedProcess:
    """The command as typed on a terminal `columns` wide (whatever width the environment carries)."""
    return subprocess.run([PY, "-m", "jobs", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {}), "COLUMNS": str(columns)})


def one_error(r: subprocess.CompletedProcess, start: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"slipway: error: {start}"), \
        (r.returncode, r.stdout, r.stderr)


@pytest.fixture
def standin(project, tmp_path) -> tuple[StandInSlurm, dict]:
    slurm = StandInSlurm(tmp_path / "slurm")
    return slurm, slurm.env()


def record(project: Path, name: str = "g") -> dict:
    return json.loads((project / "runs" / ".sweeps" / name / "sweep.json").read_text())


def submissions(project: Path, run: str) -> list[str]:
    return [s["job_id"] for s in json.loads((project / "runs" / run / "manifest.json").read_text())["submissions"]]


# ------------------------------------------------------------------ points: listed, named, validated


def test_dry_run_lists_points_resources_and_arrays_writing_nothing(project, standin):
    slurm, env = standin
    (slurm.root / "max-array-size").write_text("3")
    before = tree(project)
    r = slipway("sweep", "tiny_cpu", "--name", "g", *GRID, "--max-parallel", "2", "--dry-run", "--gpus-per-node",
                "0", env=env)
    assert r.returncode == 0, r.stderr
    for name in NAMES:
        assert re.search(rf"^{name}\s+new\s+1\s+0\s+00:30:00\s+lr=", r.stdout, re.M), r.stdout
    assert "lr=1e-3 micro_batch_size=8" in r.stdout
    assert "2.0 node-hours, 0.0 GPU-hours" in r.stdout
    assert "array 1: 3 point(s), --array=0-2%2 (at most 2 at once: --max-parallel; MaxArraySize 3" in r.stdout
    assert "array 2: 1 point(s), --array=0-0%2" in r.stdout and "--cpus-per-task=1 --time=00:30:00" in r.stdout
    assert "verdict: would be submitted" in r.stdout
    assert tree(project) == before
    assert not slurm.calls("sbatch")


@pytest.mark.parametrize("args, start", [
    (["train.lr=[1e-3, -1]"], "point g-lr-1: train.lr: must be > 0"),
    (["train.lr=[1e-3, 1e-3]"], "train.lr: the value 1e-3 is given twice"),
    (["train.lr=[]"], "train.lr: an axis needs at least one value"),
    (["run.name=[a, b]"], "run.name: a sweep names its points itself"),
    (["parallel.dp=[2, 3]"], "point g-dp3: parallel:"),
    (["train.lr=[1e-3, 0.001]"], "point g-lr0.001: has the same config as point g-lr1e-3"),
    (["train.nope=[1, 2]"], "point g-nope1: train.nope: unknown key"),
    (["slurm.output=[logs/%x.out, logs/%j.out]"], "point g-output"),
])
def test_a_bad_point_is_one_line_and_nothing_is_written(project, standin, args, start):
    slurm, env = standin
    before = tree(project)
    r = slipway("sweep", "tiny_cpu", "--name", "g", *args, env=env)
    one_error(r, start)
    assert tree(project) == before and not slurm.calls("sbatch")


def test_point_names_are_readable_bounded_safe_and_stable():
    hostile = ["$(touch pwned)", "a b'c\"d", "/scratch/x", "x" * 300, "1e-3"]
    settings = [{"train.lr": v} for v in hostile] + [{"train.lr": "1e-3", "model.dropout": "0.1"}, {}]
    names = sweeps.point_names("s", settings)
    assert len(set(names)) == len(names)
    assert all(SAFE_NAME.match(n) and len(n) <= 100 for n in names), names
    assert names[4] == "s-lr1e-3" and names[-1] == "s-base" and names[5] == "s-lr1e-3-dropout0.1"
    assert re.fullmatch(r"s-lr_scratch_x-[0-9a-f]{8}", names[2])
    # A point's name is its own values' alone: more points leave it as it was.
    assert sweeps.point_names("s", settings[:3])[:3] == names[:3]
    assert sweeps.short_keys(["model.dropout", "train.dropout", "train.lr"]) == ["model_dropout", "train_dropout", "lr"]


def test_an_axis_of_a_list_field_is_a_list_of_lists(project, standin):
    _, env = standin
    r = slipway("sweep", "tiny_cpu", "--name", "g", "launch.pre_launch=[[echo a], [echo b, echo c]]", "--dry-run",
                env=env)
    assert r.returncode == 0, r.stderr
    assert "2 point(s)" in r.stdout and "pre_launch=[echo b, echo c]" in r.stdout
    plain = slipway("sweep", "tiny_cpu", "--name", "g", "launch.pre_launch=[echo a, echo b]", "--dry-run", env=env)
    assert plain.returncode == 0 and "1 point(s)" in plain.stdout and "g-base" in plain.stdout, plain.stdout


def test_points_file_is_a_sweep_that_is_no_grid(project, standin):
    _, env = standin
    (project / "points.yaml").write_text("- {train.lr: 0.001, train.steps: 10}\n- train: {lr: 0.002}\n")
    r = slipway("sweep", "tiny_cpu", "--name", "g", "--points", "points.yaml", "--dry-run", env=env)
    assert r.returncode == 0, r.stderr
    assert "g-lr0.001-steps10" in r.stdout and "g-lr0.002 " in r.stdout
    (project / "bad.yaml").write_text("- 3\n")
    one_error(slipway("sweep", "tiny_cpu", "--points", "bad.yaml", env=env), "--points[0]")
    # The same point twice (as a map or by its sections), and the same config by other numerals.
    (project / "twice.yaml").write_text("- {train.lr: 0.001}\n- {model.num_layers: 3}\n- train: {lr: 0.001}\n")
    one_error(slipway("sweep", "tiny_cpu", "--points", "twice.yaml", env=env), "--points[2]: is --points[0] again")
    (project / "same.yaml").write_text("- {train.lr: 0.001}\n- {train.lr: 1e-3}\n")
    one_error(slipway("sweep", "tiny_cpu", "--name", "g", "--points", "same.yaml", env=env),
              "point g-lr1e-3: has the same config as point g-lr0.001 (lr=1e-3): drop one of the two")
    one_error(slipway("sweep", "tiny_cpu", "--points", str(project), env=env), "--points")


# ------------------------------------------------------------------ arrays, against a stand-in Slurm


def submit_grid(project: Path, env: dict, *extra: str) -> subprocess.CompletedProcess:
    r = slipway("sweep", "tiny_cpu", "--name", "g", *GRID, "--max-parallel", "2", *extra, env=env)
    assert r.returncode == 0, (r.stdout, r.stderr)
    return r


def test_points_go_to_arrays_split_over_max_array_size(project, standin):
    slurm, env = standin
    (slurm.root / "max-array-size").write_text("3")
    r = submit_grid(project, env)
    assert "4 to submit" in r.stdout and "submitted array 1001 (3 point(s), tasks 0-2%2)" in r.stdout, r.stdout
    assert "submitted array 1002 (1 point(s), tasks 0-0%2)" in r.stdout
    assert len(slurm.calls("sbatch")) == 2 and slurm.calls("scontrol") == ["scontrol ping", "scontrol show config"]
    rec = record(project)
    assert [p["run"] for p in rec["points"]] == NAMES and rec["axes"] == ["train.lr", "train.micro_batch_size"]
    assert rec["points"][3]["values"] == {"train.lr": "1e-3", "train.micro_batch_size": "8"}
    assert [(a["job_id"], a["points"]) for a in rec["arrays"]] == [("1001", NAMES[:3]), ("1002", NAMES[3:])]
    for i, name in enumerate(NAMES):
        assert submissions(project, name) == [f"1001_{i}" if i < 3 else "1002_0"]
    home = project / "runs" / ".sweeps" / "g"
    script = home / rec["arrays"][0]["script"]
    text = script.read_text()
    # The array asks what each point's own job.sbatch asks; task I runs point I's job.sbatch.
    own = (project / "runs" / NAMES[0] / "job.sbatch").read_text().splitlines()
    shared = [line for line in own if line.startswith("#SBATCH") and not line.startswith(
        ("#SBATCH --job-name", "#SBATCH --output", "#SBATCH --error"))]
    assert all(line in text.splitlines() for line in shared)
    assert "#SBATCH --array=0-2%2" in text and "#SBATCH --job-name=g" in text
    assert f"POINTS=({' '.join(NAMES[:3])})" in text
    assert re.search(r"#SBATCH --output=.*/%a/logs/%A_%a\.out", text)
    for i, name in enumerate(NAMES[:3]):
        assert (script.parent / str(i)).resolve() == (project / "runs" / name).resolve()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_rerun_submits_only_what_is_not_finished_and_adds_new_points(project, standin):
    slurm, env = standin
    submit_grid(project, env)
    runs = project / "runs"
    # Point 0 completed all its steps, point 1 runs, points 2 and 3 failed.
    append_event(runs / NAMES[0], "1001_0", "end exit 0")
    slurm.job("1001_0", "COMPLETED", where="ctld")
    slurm.job("1001_1", "RUNNING", where="ctld")
    for i in (2, 3):
        append_event(runs / NAMES[i], f"1001_{i}", "end exit 1")
        slurm.job(f"1001_{i}", "FAILED", "1:0", where="ctld")
    r = submit_grid(project, env)
    assert "2 to resume, 1 finished, 1 queued or running; 2 to submit" in r.stdout, r.stdout
    assert "submitted array 1002 (2 point(s)" in r.stdout
    assert [submissions(project, n) for n in NAMES] == [["1001_0"], ["1001_1"], ["1001_2", "1002_0"],
                                                        ["1001_3", "1002_1"]]
    # Another value on an axis adds its points; the others are where they were.
    more = slipway("sweep", "tiny_cpu", "--name", "g", "train.lr=[3e-3, 1e-3, 2e-3]", "train.micro_batch_size=[4, 8]",
                   env=env)
    assert more.returncode == 0 and "2 new, 1 finished, 3 queued or running; 2 to submit" in more.stdout, more.stdout
    assert [p["run"] for p in record(project)["points"]][4:] == ["g-lr2e-3-micro_batch_size4",
                                                                 "g-lr2e-3-micro_batch_size8"]
    assert len(record(project)["arrays"]) == 3


def test_a_changed_point_config_is_refused_unless_force(project, standin):
    slurm, env = standin
    submit_grid(project, env)
    for i in range(4):
        append_event(project / "runs" / NAMES[i], f"1001_{i}", "end exit 1")
        slurm.job(f"1001_{i}", "FAILED", "1:0", where="ctld")
    before = record(project)
    r = slipway("sweep", "tiny_cpu", "--name", "g", *GRID, "train.steps=300", env=env)
    one_error(r, f"point {NAMES[0]}: exists with a different config (train.steps 200 -> 300) (and 3 more point(s))")
    assert record(project) == before and len(slurm.calls("sbatch")) == 1
    forced = slipway("sweep", "tiny_cpu", "--name", "g", *GRID, "train.steps=300", "--force", env=env)
    assert forced.returncode == 0 and "4 to submit" in forced.stdout, forced.stderr
    assert list((project / "runs" / NAMES[0] / "history").glob("config-*.yaml"))


@pytest.mark.slow
def test_hostile_state_damaged_record_and_a_run_of_a_points_name(project, standin):
    slurm, env = standin
    # A run of a point's name that is no point of the sweep: refused, nothing written.
    other = slipway("submit", "tiny_cpu", "--run-name", NAMES[1], env=env)
    assert other.returncode == 0, other.stderr
    before = tree(project)
    one_error(slipway("sweep", "tiny_cpu", "--name", "g", *GRID, env=env), f"point {NAMES[1]}: run.name:")
    assert tree(project) == before
    # A sweep named as a run would be found as the run.
    one_error(slipway("sweep", "tiny_cpu", "--name", NAMES[1], "train.lr=[1e-3]", env=env), "--name")
    # A damaged record: one line naming it, for every command; never written over.
    submit_grid(project, env, "--name", "h")
    path = project / "runs" / ".sweeps" / "h" / "sweep.json"
    path.write_text('{"points": [{"run": "x"')
    for args in (["status", "h"], ["compare", "h"], ["cancel", "h"], ["plot", "h"],
                 ["sweep", "tiny_cpu", "--name", "h", *GRID]):
        one_error(slipway(*args, env=env), str(path))
    assert path.read_text() == '{"points": [{"run": "x"'
    path.write_text(json.dumps({"schema": 1, "points": [{"run": "../x"}]}))
    one_error(slipway("status", "h", env=env), str(path))


def test_two_sweeps_of_one_name_at_once_submit_each_point_once(project, standin):
    slurm, env = standin
    argv = [PY, "-m", "jobs", "sweep", "tiny_cpu", "--name", "g", *GRID]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **env}) for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert len(slurm.calls("sbatch")) == 1
    assert sorted(len(submissions(project, n)) for n in NAMES) == [1, 1, 1, 1]
    assert any("4 queued or running; nothing to submit" in out for out, _ in outs), outs


# ------------------------------------------------------------------ reading a sweep


def metrics(run_dir: Path, losses: list[float], evals: float, tps: float = 12345.0) -> None:
    lines = [json.dumps({"kind": "train", "step": s, "loss": loss, "tokens_per_s": tps, "mfu": 0.41})
             for s, loss in enumerate(losses, 1)]
    lines.append(json.dumps({"kind": "eval", "step": len(losses), "eval_loss": evals}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


@pytest.fixture
def ended(project, standin) -> tuple[StandInSlurm, dict]:
    """The 2 x 2 grid submitted and ended: points 0-2 completed with metrics, 3 still queued."""
    slurm, env = standin
    submit_grid(project, env)
    for i, (loss, ev) in enumerate([(4.0, 4.5), (3.0, 3.2), (5.0, 5.5)]):
        metrics(project / "runs" / NAMES[i], [9.0, loss], ev, tps=1000.0 * (i + 1))
        append_event(project / "runs" / NAMES[i], f"1001_{i}", "end exit 0")
    return slurm, env


def test_status_of_a_sweep_is_one_line_a_point_and_two_slurm_calls(project, ended):
    slurm, env = ended
    slurm.reset_calls()
    r = slipway("status", "g", env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("sweep g: 4 point(s) (3 COMPLETED, 1 PENDING); arrays 1001"), lines[0]
    assert [line.split()[0] for line in lines[2:]] == NAMES
    assert "step 2/200, loss 3.000, 2k tok/s" in r.stdout
    assert len(slurm.state_calls()) <= 2 and slurm.state_calls()[0].startswith("squeue")
    # A point is a run: every command takes it by its name.
    assert slipway("status", NAMES[1], env=env).returncode == 0


def test_compare_ranks_by_eval_loss_in_80_columns_and_csv(project, ended):
    _, env = ended
    r = slipway("compare", "g", env=env, columns=80)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), r.stdout
    assert lines[1].split()[:4] == ["lr", "micro_batch_size", "eval", "train"]
    rows = [line for line in lines[2:] if not line.startswith("    ")]  # a run's name on its own line below
    assert [line.split()[2] for line in rows[:3]] == ["3.2000", "4.5000", "5.5000"]
    assert rows[0].split()[:2] == ["3e-3", "8"] and "41.0%" in rows[0] and "2/200" in rows[0]
    rows = list(csv.DictReader(io.StringIO(slipway("compare", "g", "--csv", env=env).stdout)))
    assert [row["run"] for row in rows] == [NAMES[1], NAMES[0], NAMES[2], NAMES[3]]
    assert rows[0]["train.lr"] == "3e-3" and rows[0]["eval_loss"] == "3.2" and rows[3]["state"] == "PENDING"
    # Any runs: the keys that tell them apart.
    mixed = slipway("compare", NAMES[0], NAMES[2], env=env)
    assert mixed.returncode == 0 and mixed.stdout.splitlines()[1].split()[0] == "lr", mixed.stdout


def test_plot_of_a_sweep_overlays_its_points(project, ended):
    _, env = ended
    r = slipway("plot", "g", env=env)
    assert r.returncode == 0, r.stderr
    png = project / "runs" / ".sweeps" / "g" / "curves.png"
    assert r.stdout.strip() == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cancel_of_a_sweep_cancels_every_task(project, standin):
    slurm, env = standin
    submit_grid(project, env)
    slurm.job("1001_0", "RUNNING", where="ctld")
    r = slipway("cancel", "g", env=env)
    assert r.returncode == 0 and "cancelled 4 task(s) of sweep g" in r.stdout, (r.stdout, r.stderr)
    # The pending tasks first (they would start as the running one ends), then the running
    # task's batch shell is asked to stop; every task is ended.
    assert slurm.calls("scancel") == ["scancel 1001_1 1001_2 1001_3", "scancel --signal=USR2 --batch 1001_0"]
    for name in NAMES[1:]:
        assert "cancelled by slipway cancel" in (project / "runs" / name / "events.log").read_text()
    assert slipway("cancel", "g", env=env).stdout.strip() == "sweep g has no active task"


# ------------------------------------------------------------------ tried here first


def test_local_sweep_checks_every_point_fits_before_running_any(project):
    before = tree(project)
    r = slipway("sweep", "tiny_cpu", "--name", "g", "train.micro_batch_size=[2, 4096]", "data.seq_len=4096",
                "model.max_position_embeddings=4096", "--local")
    one_error(r, "point g-micro_batch_size4096: train.micro_batch_size:")
    assert tree(project) == before


def test_a_numeric_key_given_values_by_commas_names_the_axis_form(project):
    """Hydra's multirun form (`train.lr=1e-3,1e-2`) is one value to slipway: for a number or a flag
    field, one line with the axis to paste; a string field keeps its commas."""
    before = tree(project)
    for given, axis in (("train.lr=1e-3,1e-2", "'train.lr=[1e-3, 1e-2]'"),
                        ("train.steps= 10, 20", "'train.steps=[10, 20]'")):
        r = slipway("sweep", "tiny_cpu", "--name", "g", given, "--dry-run")
        one_error(r, f"{given.split('=')[0]}: ")
        assert f"is one value, not an axis: give {axis}" in r.stderr, r.stderr
    assert tree(project) == before
    r = slipway("sweep", "tiny_cpu", "--name", "g", "train.lr=[3e-3, 1e-3]", "run.project=a,b", "--local", "--dry-run")
    assert r.returncode == 0, (r.stdout, r.stderr)


def test_local_sweep_dry_run_is_the_local_plan_with_no_slurm_asked(project, standin):
    slurm, env = standin
    before = tree(project)
    r = slipway("sweep", "tiny_cpu", "--name", "g", "train.lr=[3e-3, 1e-3]", "--local", "--dry-run", env=env)
    assert r.returncode == 0, (r.stdout, r.stderr)
    lines = r.stdout.splitlines()
    assert lines[0] == "dry run: sweep g: 2 point(s): 2 new; 2 to run here; nothing written, nothing started"
    # No Slurm allocation, so no nodes, GPUs or time limit shown for a point
    assert lines[1].split() == ["point", "state", "values"] and lines[2].split() == ["g-lr3e-3", "new", "lr=3e-3"]
    assert lines[-3:] == ["one after another, each as slipway local runs it", "verdict: would be started",
                          "dry run: nothing written; would be started"], lines
    assert "array" not in r.stdout and slurm.calls() == [] and tree(project) == before


@pytest.mark.slow
@pytest.mark.multiproc
def test_local_sweep_runs_each_point_through_slipway_local(project):
    r = slipway("sweep", "tiny_cpu", "--name", "g", *TINY, "train.steps=2", "train.eval_interval=0",
                "train.lr=[3e-3, 1e-3]", "--local", timeout=600)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "sweep g: 2 of 2 point(s) ended 0" in r.stdout
    for name in ("g-lr3e-3", "g-lr1e-3"):
        launches = json.loads((project / "runs" / name / "manifest.json").read_text())["submissions"]
        assert [x.get("local") for x in launches] == [True]
        assert (project / "runs" / name / "metrics.jsonl").is_file()
    again = slipway("sweep", "tiny_cpu", "--name", "g", *TINY, "train.steps=2", "train.eval_interval=0",
                    "train.lr=[3e-3, 1e-3]", "--local", timeout=600)
    assert again.returncode == 0 and "nothing to train" in again.stdout, again.stdout
    # Its hint repeats the point's own arguments: the axis replaced by the point's value.
    assert "train.lr=3e-3 --run-name g-lr3e-3 --train-steps 4 --force" in " ".join(again.stdout.split()), again.stdout


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_local_sweep_longer_than_a_try_says_the_steps_that_fit_and_starts_with_yes(project):
    """A point past a try's half hour, without a terminal to ask: refused, each point, with the
    steps that fit (no `slipway local` command stands for a sweep's point); with --yes it starts,
    and Ctrl-C stops the sweep there: the next point never starts."""
    from test_first_hour import launch_reading
    from test_stopping import losses, wait_for as waiting

    args = ("sweep", "tiny_cpu", "--name", "g", *TINY, "train.eval_interval=0", "train.steps=1000000",
            "train.lr=[3e-3, 1e-3]", "--local")
    r = slipway(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    refused = [x for x in r.stderr.splitlines() if x.startswith("slipway: error: ")]
    assert len(refused) == 2 and all(re.fullmatch(
        r"slipway: error: train\.steps: 1000000 steps of ~\S+ take ~\S+ here, more than a try on this machine "
        r"\(30m00s\): train\.steps=\d+ fits, or --yes starts it all the same", x) for x in refused), r.stderr
    assert "nothing smaller" not in r.stderr and "sweep g: 0 of 2 point(s) ended 0" in r.stdout
    assert not [p for p in (project / "runs").iterdir() if not p.name.startswith(".")]
    proc = launch_reading(*args, "--yes")
    try:
        waiting(lambda: (project / "runs" / "g-lr3e-3" / "metrics.jsonl").is_file()
                and len(losses(project / "runs" / "g-lr3e-3")) >= 1, 240, "the first point's first step")
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 130, proc.lines[-20:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not (project / "runs" / "g-lr1e-3").exists(), proc.lines[-20:]
    assert any("sweep g: 0 of 2 point(s) ended 0; g-lr3e-3 exit 130" in x for x in proc.lines), proc.lines[-10:]


# ------------------------------------------------------------------ the real local Slurm


def wait_for(predicate, timeout: float, what: str, poll: float = 0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


def active_tasks(*arrays: str) -> list[str]:
    """squeue's lines for the tasks of `arrays` that Slurm still queues or runs: ARRAY_TASK STATE."""
    r = subprocess.run(["squeue", "--array", "--noheader", f"--jobs={','.join(arrays)}",
                        "--Format=JobArrayID:|,State:"], capture_output=True, text=True)
    return [line.replace("|", " ").strip() for line in r.stdout.splitlines() if line.strip()]


def train_losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train":
            out[rec["step"]] = rec["loss"]
    return out


def train_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()
            if json.loads(line).get("kind") == "train"] if path.exists() else []


def checkpoints(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*/COMPLETE"))


@pytest.mark.slurm
def test_grid_trains_as_one_array_and_a_killed_point_resumes_exactly(project, slurm_env):
    """Its points differ in the learning rate and in the checkpoint interval, which changes no
    loss: a point's sibling with the other interval is its uninterrupted reference. One point is
    killed mid-run (the re-run of the sweep submits it alone), another warned of its time limit
    (its task requeues itself alone, as a run's job does)."""
    from test_e2e import sigkill_one_worker

    args = ["sweep", "tiny_cpu", "--name", "g", *TINY, "train.micro_batch_size=16", "train.steps=20",
            "train.eval_interval=10", "train.lr=[3e-3, 1e-3]", "checkpoint.interval=[2, 50]", "--max-parallel", "4"]
    r = slipway(*args)
    assert r.returncode == 0, (r.stdout, r.stderr)
    array = record(project)["arrays"][0]["job_id"]
    assert "submitted array" in r.stdout and len(record(project)["arrays"]) == 1
    runs = project / "runs"
    killed, sibling = runs / "g-lr3e-3-interval2", runs / "g-lr3e-3-interval50"
    warned, warned_sibling = runs / "g-lr1e-3-interval2", runs / "g-lr1e-3-interval50"
    shown = subprocess.run(["scontrol", "show", "job", f"{array}_0"], capture_output=True, text=True).stdout
    assert f"ArrayJobId={array} ArrayTaskId=0" in shown, shown
    wait_for(lambda: checkpoints(killed) and len(train_steps(killed)) >= 3, 300, "a checkpoint and three steps")
    sigkill_one_worker(killed.name)
    # What Slurm does for --signal=B:USR1@N near the time limit: the task saves and requeues itself.
    wait_for(lambda: len(train_steps(warned)) >= 3, 300, "three steps of the warned point")
    subprocess.run(["scancel", "--signal=USR1", "--batch", f"{array}_2"], check=True)
    wait_for(lambda: "requeueing" in (warned / "events.log").read_text(), 120, "the task to requeue itself")
    wait_for(lambda: f"{array}_2 PENDING" in active_tasks(array), 60, "the task to be pending again")
    time.sleep(3)  # a requeued task's credential expires first (see test_e2e): let it start at once
    subprocess.run(["scontrol", "update", f"JobId={array}_2", "StartTime=now"], check=True, capture_output=True)
    wait_for(lambda: not active_tasks(array), 400, "every task of the array to end")
    events = (warned / "events.log").read_text()
    assert f"job {array}_2 time-limit requeue 1/" in events and f"job {array}_2 start on" in events, events
    assert "(restart 1)" in events and "(restart 1)" not in (warned_sibling / "events.log").read_text()
    for step, loss in train_losses(warned_sibling).items():
        assert train_losses(warned)[step] == pytest.approx(loss, abs=1e-6), step
    status = slipway("status", "g")
    assert status.returncode == 0 and "(3 COMPLETED, 1 FAILED)" in status.stdout, status.stdout
    for name in ("g-lr3e-3-interval50", "g-lr1e-3-interval2", "g-lr1e-3-interval50"):
        assert train_steps(runs / name)[-1] == 20 and f"job {array}_" in (runs / name / "events.log").read_text()
        assert list((runs / name / "logs").glob(f"{array}_*.out"))  # each task's log is its run's own
    last = checkpoints(killed)[-1]
    assert last < 20

    again = slipway(*args)
    assert again.returncode == 0 and "1 to resume, 3 finished; 1 to submit" in again.stdout, again.stdout
    second = record(project)["arrays"][1]
    assert second["points"] == [killed.name]
    wait_for(lambda: not active_tasks(second["job_id"]), 300, "the resumed point to end")
    records = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    restart = max(i for i, rec in enumerate(records) if rec.get("kind") == "restart")  # the first is step 0
    assert records[restart]["step"] == last, records[restart]  # resumed from its latest checkpoint
    assert next(rec["step"] for rec in records[restart:] if rec.get("kind") == "train") == last + 1
    assert train_steps(killed)[-1] == 20
    reference, got = train_losses(sibling), train_losses(killed)
    assert sorted(got) == sorted(reference) == list(range(1, 21))
    for step in reference:
        assert got[step] == pytest.approx(reference[step], abs=1e-6), step
    compared = slipway("compare", "g", "--csv")
    rows = list(csv.DictReader(io.StringIO(compared.stdout)))
    assert len(rows) == 4 and {row["state"] for row in rows} == {"COMPLETED"}, compared.stdout
    assert [float(row["eval_loss"]) for row in rows] == sorted(float(row["eval_loss"]) for row in rows)


@pytest.mark.slurm
def test_split_over_max_array_size_and_cancel_ends_every_task(project, slurm_env):
    sleep = ["launch.launcher=srun", "launch.procs_per_node=1", "--dp", "1",
             f"launch.command=[{PY}, -c, 'import time; time.sleep(120)']"]
    r = slipway("sweep", "tiny_cpu", "--name", "s", *sleep, "train.lr=[1e-3, 2e-3, 3e-3, 4e-3, 5e-3]",
                "--max-parallel", "2")
    assert r.returncode == 0, (r.stdout, r.stderr)
    arrays = record(project, "s")["arrays"]
    assert [len(a["points"]) for a in arrays] == [4, 1], arrays  # MaxArraySize 4: indices 0-3
    ids = [a["job_id"] for a in arrays]
    wait_for(lambda: sum(t.endswith("RUNNING") for t in active_tasks(*ids)) >= 3, 120, "three running tasks")
    assert any(t.endswith("PENDING") for t in active_tasks(*ids))  # the throttle (%2) holds the others
    cancelled = slipway("cancel", "s", timeout=300)
    assert cancelled.returncode == 0 and "cancelled 5 task(s) of sweep s" in cancelled.stdout, \
        (cancelled.stdout, cancelled.stderr)
    assert active_tasks(*ids) == []
    for point in record(project, "s")["points"]:
        assert "cancelled by slipway cancel" in (project / "runs" / point["run"] / "events.log").read_text()
    status = slipway("status", "s")
    assert "(5 CANCELLED)" in status.stdout, status.stdout


# ------------------------------------------------------------------ never hide, never crash (issue 50)

# A point's file in another state than its job left it: what stands in its place.
DAMAGE = {"fifo-metrics": ("metrics.jsonl", os.mkfifo), "fifo-events": ("events.log", os.mkfifo),
          "binary-manifest": ("manifest.json", lambda p: p.write_bytes(b"\x00\xff" * 64))}


def _damage(run_dir: Path, how: str) -> None:
    name, make = DAMAGE[how]
    (run_dir / name).unlink(missing_ok=True)
    make(run_dir / name)


@pytest.mark.slow
@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_one_damaged_point_is_marked_and_every_other_is_compared(project, ended, how):
    _, env = ended
    _damage(project / "runs" / NAMES[1], how)
    for args in (["compare", "g"], ["compare", "g", "--csv"], ["status", "g"]):
        r = slipway(*args, env=env, timeout=90)
        errors = r.stderr.splitlines()
        assert r.returncode == 2 and len(errors) == 1 and NAMES[1] in errors[0], (args, r.stderr)
        assert errors[0].startswith("slipway: error: ") and "Traceback" not in r.stderr
        assert all(name in r.stdout for name in NAMES), (args, r.stdout)
        marked = [line for line in r.stdout.splitlines() if NAMES[1] in line]
        assert len(marked) == 1 and "DAMAGED" in marked[0], (args, r.stdout)
    plot = slipway("plot", "g", env=env, timeout=90)
    assert plot.returncode == 0 and plot.stdout.strip().endswith("curves.png"), plot.stderr
    assert (NAMES[1] in plot.stderr) == (how == "fifo-metrics"), plot.stderr  # the plot reads metrics alone
    # A re-run leaves the damaged point as it is, says so, and plans the others.
    again = slipway("sweep", "tiny_cpu", "--name", "g", *GRID, "--max-parallel", "2", env=env, timeout=90)
    if how == "fifo-metrics":  # the re-run reads no metrics: the point is finished
        assert again.returncode == 0 and "3 finished, 1 queued or running" in again.stdout, again.stdout
    else:
        assert again.returncode == 0 and "2 finished, 1 queued or running, 1 unreadable" in again.stdout, \
            (again.stdout, again.stderr)
        assert f"run {NAMES[1]}: " in again.stdout and "left as it is, not submitted" in again.stdout


def test_compare_of_runs_names_a_config_it_cannot_read(project, ended):
    _, env = ended
    (project / "runs" / NAMES[2] / "config.yaml").write_bytes(b"\xff\xfe" * 40)
    r = slipway("compare", NAMES[0], NAMES[2], env=env)
    assert r.returncode == 0 and NAMES[0] in r.stdout and NAMES[2] in r.stdout, (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and f"run {NAMES[2]}: config.yaml cannot be read" in r.stderr, r.stderr


@pytest.mark.parametrize("answer, said", [("0", None), ("-1", "'-1'"), ("abc", "'abc'"), ("", "''")])
def test_max_array_size_zero_submits_points_as_jobs_and_a_garbled_one_is_named(project, standin, answer, said):
    slurm, env = standin
    (slurm.root / "max-array-size").write_text(answer)
    dry = slipway("sweep", "tiny_cpu", "--name", "g", *GRID, "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    r = slipway("sweep", "tiny_cpu", "--name", "g", *GRID, env=env)
    if said is None:  # a site without arrays: each point is a job of its own, as `submit` queues it
        assert "no arrays: MaxArraySize 0 (scontrol show config)" in dry.stdout, dry.stdout
        assert r.returncode == 0 and [submissions(project, n) for n in NAMES] == [["1001"], ["1002"], ["1003"],
                                                                                  ["1004"]], (r.stdout, r.stderr)
        assert "submitted job 1001 (point g-lr3e-3-micro_batch_size4)" in r.stdout
        assert slurm.calls("sbatch")[0].endswith(f"{NAMES[0]}/job.sbatch")
        status = slipway("status", "g", env=env)
        assert status.returncode == 0 and [line.split()[3] for line in status.stdout.splitlines()[2:]] == \
            ["PENDING"] * 4, status.stdout
    else:
        assert f"MaxArraySize = {said}, no count of tasks" in dry.stdout, dry.stdout
        assert r.returncode == 1 and r.stderr.startswith(f"slipway: error: scontrol show config says MaxArraySize = "
                                                         f"{said}, no count of tasks") and r.stderr.count("\n") == 1
        assert not (project / "runs" / NAMES[0]).exists() and not (project / "runs" / ".sweeps" / "g").exists()


def test_an_array_runs_at_most_256_tasks_at_once_unless_told(project, standin):
    from jobs.runs.arrays import array_spec

    _, env = standin
    assert (array_spec(1000, None), array_spec(4, None), array_spec(1000, 50)) == ("0-999%256", "0-3%4", "0-999%50")
    r = slipway("sweep", "tiny_cpu", "--name", "g", *GRID, "--dry-run", env=env)
    assert "--array=0-3%4 (at most 4 at once: --max-parallel" in r.stdout, r.stdout


@pytest.fixture
def teammates_sweep(teammate) -> tuple:
    """The 2 x 2 grid ended as in `ended`, in a project a second user owns, but for two points of
    root's: one whose run directory is closed (0700), one whose metrics.jsonl is (0600)."""
    project = teammate.shared / "proj"
    shutil.copytree(Path(__file__).resolve().parent.parent / "configs", project / "configs")
    slurm = StandInSlurm(teammate.shared / "slurm")
    mine = {**os.environ, **slurm.env(), "SLIPWAY_PROJECT": str(project)}
    made = subprocess.run([PY, "-m", "jobs", "sweep", "tiny_cpu", "--name", "g", *GRID], cwd=project, env=mine,
                          capture_output=True, text=True, timeout=240)
    assert made.returncode == 0, made.stderr
    for i, (loss, ev) in enumerate([(4.0, 4.5), (3.0, 3.2), (5.0, 5.5)]):
        metrics(project / "runs" / NAMES[i], [9.0, loss], ev)
        append_event(project / "runs" / NAMES[i], f"1001_{i}", "end exit 0")
    subprocess.run(["chown", "-R", f"{teammate.uid}:{teammate.gid}", str(project), str(slurm.root)], check=True)
    os.chown(project / "runs" / NAMES[1], 0, 0)
    (project / "runs" / NAMES[1]).chmod(0o700)
    os.chown(project / "runs" / NAMES[2] / "metrics.jsonl", 0, 0)
    (project / "runs" / NAMES[2] / "metrics.jsonl").chmod(0o600)
    env = teammate.env(PATH=f"{slurm.bin}:{os.environ['PATH']}", STANDIN=str(slurm.root), SLIPWAY_PROJECT=str(project))
    return teammate, env, project


@pytest.mark.slow
def test_a_teammates_points_are_marked_and_every_other_is_compared(teammates_sweep):
    mate, env, project = teammates_sweep
    closed = {NAMES[1]: "not readable by you (owned by root, mode 0700)",
              NAMES[2]: "metrics.jsonl not readable by you (owned by root, mode 0600)"}
    for args in (["compare", "g"], ["compare", "g", "--csv"], ["status", "g"]):
        r = mate.slipway(*args, env=env, cwd=project)
        assert r.returncode == 0 and "error" not in r.stderr, (args, r.stderr)  # a teammate's point is no damage
        assert all(name in r.stdout for name in NAMES), (args, r.stdout)
        for name, why in closed.items():
            assert [line for line in r.stdout.splitlines() if name in line and "UNREADABLE" in line], (args, r.stdout)
            assert why in r.stdout + r.stderr, (args, name, r.stdout, r.stderr)
    plot = mate.slipway("plot", "g", env=env, cwd=project)
    assert plot.returncode == 0 and plot.stdout.strip().endswith("curves.png"), plot.stderr
    assert all(f"{name} left out of the plot" in plot.stderr for name in closed), plot.stderr
    again = mate.slipway("sweep", "tiny_cpu", "--name", "g", *GRID, env=env, cwd=project)
    assert again.returncode == 0 and "1 unreadable" in again.stdout and closed[NAMES[1]] in again.stdout, \
        (again.stdout, again.stderr)


def test_control_characters_in_free_text_and_in_what_a_job_wrote_reach_no_csv_or_table_raw(project, standin):
    _, env = standin
    r = slipway("sweep", "tiny_cpu", "--name", "e", "container.env.SLIPWAY_X=[a\x1bb, c\u202ed\x07]", env=env)
    assert r.returncode == 0, r.stderr
    points = [p["run"] for p in record(project, "e")["points"]]
    (project / "runs" / points[0] / "metrics.jsonl").write_text(json.dumps(
        {"kind": "train", "step": 3, "loss": "\x1b]0;PWNED\x07", "tokens_per_s": "\u2066x"}) + "\n")
    for args in (["compare", "e", "--csv"], ["compare", "e"], ["status", "e"]):
        out = slipway(*args, env=env)
        assert out.returncode == 0, out.stderr
        raw = sorted({c for c in out.stdout + out.stderr if c != "\n" and one_line(c) != c})
        assert not raw and ("a\\x1bb" in out.stdout or args[0] == "status"), (args, raw, out.stdout)


@pytest.mark.parametrize("settings", [
    {"train.lr": "1e-3"}, {"train.lr": "3e-3", "train.warmup_steps": "5", "run.seed": "7"},
    {"model.size": "small"}, {"model.hidden_size": "128", "model.num_heads": "4"}, {"slurm.nodes": "2"},
    {"slurm.nodes": "2", "parallel.dp": "4"}, {"container.env.X": "y"}, {"slurm.time": "10:00"}, {"train.lr": "-1"},
    {"train.min_lr": "1", "train.lr": "2"}, {"train.min_lr": "1"}, {"train.min_lr": "1e-3", "train.lr": "5e-4"},
    {"slurm.partition": "a\x1bb"}, {"train.steps": "x"},
    {"data.cache_dir": "/tmp/" + "a" * 300}, {"launch.command": ["python3", "x.py"]}, {"nope.x": "1"}])
def test_a_points_config_built_from_the_base_is_the_one_read_whole(settings):
    """`Variants` (each setting read once, points built from the base) gives each point the config,
    or the error, that reading its whole tree gives."""
    _built_as_whole(settings, ["train.steps=50"])


@pytest.mark.parametrize("base, settings", [
    ([], {"container.runtime": "pyxis"}), ([], {"container.runtime": "edf"}),  # launch.python: python3 there
    (["launch.procs_per_node=null", "parallel.dp=1"], {"slurm.gpus_per_node": "2"}),  # 2 ranks, not the base's 1
    (["launch.procs_per_node=null", "parallel.dp=1"], {"slurm.gpus_per_node": "2", "parallel.dp": "2"}),
    (["slurm.cpus_per_task=null"], {"launch.preset": "alps-gh200", "slurm.gpus_per_node": "4", "parallel.dp": "4"})])
def test_what_the_base_derived_a_point_derives_from_its_own_values(base, settings):
    _built_as_whole(settings, base)


def _built_as_whole(settings: dict, base: list[str]) -> None:
    from jobs.config import config_from, read_config
    from jobs.runs.sweep import Variants

    path, raw = read_config(Path(__file__).resolve().parent.parent / "configs" / "tiny_cpu.yaml")
    variants = Variants(path, raw, base, {}, None)

    def built(make):
        try:
            return make()
        except ConfigError as exc:
            return str(exc)
    for _ in range(2):  # the second time from what the first read
        fast = built(lambda: variants(settings, "p-1"))
        whole = built(lambda: config_from(path, raw, base, {}, {**settings, "run.name": "p-1"}))
        assert fast == whole, (settings, fast, whole)
