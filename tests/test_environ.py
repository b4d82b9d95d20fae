"""The environment is input (common/environ.py): Slurm's variables, wherever slipway reads them,
are checked like config values. Through `slipway run` (the command that reads the allocation from
its shell) and through the trainer's own readers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import squeue_answering, stand_in, tree
from common import environ
from common.errors import ConfigError

PY = sys.executable
HOSTILE = ["../../etc", "1;touch pwned", "$(touch pwned)", " 12", "12\n", "-1", "1e3", "x" * 200, "1/2"]


@pytest.mark.parametrize("value", HOSTILE)
def test_a_hostile_job_id_is_refused_naming_the_variable(value):
    with pytest.raises(ConfigError, match=r"^\$SLURM_JOB_ID: .* is not a Slurm job id \(a whole number\)"):
        environ.job_id({"SLURM_JOB_ID": value})
    assert environ.job_id({"SLURM_JOB_ID": "123456"}) == "123456" and environ.job_id({}) is None


@pytest.mark.parametrize("name", ["SLURM_NNODES", "RANK", "LOCAL_RANK", "WORLD_SIZE"])
def test_counts_are_whole_numbers(name):
    for value in ("2;rm", "-1", "two", "1.5"):
        with pytest.raises(ConfigError, match=rf"^\${name}: "):
            environ.count(name, {name: value})
    assert environ.count(name, {name: "0"}) == 0 and environ.count(name, {name: ""}) is None


def test_the_trainers_file_names_take_only_safe_words(monkeypatch):
    from trainer.watchdog import dump_path, job_tag, node_name

    monkeypatch.setenv("SLIPWAY_JOB_TAG", "41r2")
    monkeypatch.setenv("SLURMD_NODENAME", "nid001234")
    assert dump_path(Path("/r"), 3) == Path("/r/hangs/41r2-nid001234-3.txt")
    for name in ("SLIPWAY_JOB_TAG", "SLURMD_NODENAME"):
        monkeypatch.setenv(name, "../../../tmp/x")
        with pytest.raises(ConfigError, match=rf"^\${name}: "):
            job_tag() if name == "SLIPWAY_JOB_TAG" else node_name()
        monkeypatch.setenv(name, "ok")
    monkeypatch.delenv("SLIPWAY_JOB_TAG")
    monkeypatch.setenv("SLURM_JOB_ID", "../7")
    with pytest.raises(ConfigError, match=r"^\$SLURM_JOB_ID: "):
        job_tag()


def _run(project: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "jobs", "run", "tiny_cpu"], cwd=project, capture_output=True, text=True,
                          timeout=120, env={**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
                                            **env})


def _one_line(r: subprocess.CompletedProcess, start: str) -> str:
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"slipway: error: {start}"), r.stderr
    return lines[0]


@pytest.mark.parametrize("variable, value", [("SLURM_JOB_ID", "../../x"), ("SLURM_JOB_ID", "$(touch pwned)"),
                                             ("SLURM_NNODES", "2;touch pwned"), ("SLURM_JOB_NUM_NODES", "-3")])
def test_slipway_run_refuses_hostile_slurm_values_before_writing_anything(project, tmp_path, variable, value):
    bin_dir = tmp_path / "fake-slurm"
    stand_in(bin_dir, "squeue", squeue_answering("RUNNING"))
    before = tree(project)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", variable: value}
    _one_line(_run(project, env), f"${variable}: ")
    assert tree(project) == before and not list(project.parent.rglob("pwned"))


@pytest.mark.parametrize("state, said", [("", "is unknown to Slurm"), ("COMPLETED", "is COMPLETED")])
def test_slipway_run_outside_a_live_allocation_is_one_line_before_anything_is_written(project, tmp_path, state,
                                                                                      said):
    """A shell left from an allocation that ended still says its id: Slurm is asked."""
    bin_dir = tmp_path / "fake-slurm"
    stand_in(bin_dir, "squeue", squeue_answering(state) if state else "exit 0\n")
    stand_in(bin_dir, "sacct", "exit 0\n")
    before = tree(project)
    line = _one_line(_run(project, {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77"}),
                     "$SLURM_JOB_ID: ")
    assert f"allocation 77 {said}, not running" in line and "salloc --nodes=1" in line
    assert tree(project) == before
