"""The environment is input (common/environ.py): Slurm's variables, wherever slipway reads them,
are checked like config values. Through `slipway run` (the command that reads the allocation from
its shell) and through the trainer's own readers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import squeue_answering, stand_in, tree
from slurm_standin import StandInSlurm
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


@pytest.mark.parametrize("variable, value", [("SLURM_RESTART_COUNT", "abc"), ("SLURM_RESTART_COUNT", "1;touch pwned"),
                                             ("SLURM_JOB_NODELIST", "node[1-2];touch pwned"),
                                             ("SLURM_JOB_NODELIST", "$(touch pwned)"),
                                             ("SLURM_JOB_PARTITION", "../../x")])
def test_slipway_run_checks_what_the_batch_script_reads_of_the_allocation(project, tmp_path, variable, value):
    """The batch script `slipway run` starts reads these: a bad one was `exit 1` with no message."""
    bin_dir = tmp_path / "fake-slurm"
    stand_in(bin_dir, "squeue", squeue_answering("RUNNING"))
    before = tree(project)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "node1",
           variable: value}
    _one_line(_run(project, env), f"${variable}: ")
    assert tree(project) == before and not list(project.parent.rglob("pwned"))


def test_durations_from_the_environment_are_positive_numbers():
    assert environ.seconds("SLIPWAY_DATA_TIMEOUT_S", 1800, {}) == 1800
    assert environ.seconds("SLIPWAY_DATA_TIMEOUT_S", 1800, {"SLIPWAY_DATA_TIMEOUT_S": ""}) == 1800
    assert environ.seconds("SLIPWAY_DATA_TIMEOUT_S", 1800, {"SLIPWAY_DATA_TIMEOUT_S": "2.5"}) == 2.5
    for value in ("abc", "-1", "0", "nan", "inf", "1e300", "1" * 50):
        with pytest.raises(ConfigError, match=r"^\$SLIPWAY_DATA_TIMEOUT_S: .* is not a number of seconds"):
            environ.seconds("SLIPWAY_DATA_TIMEOUT_S", 1800, {"SLIPWAY_DATA_TIMEOUT_S": value})


# ---------------------------------------------------------------- SLIPWAY_* through the CLI


def _standin(slurm: StandInSlurm) -> dict[str, str]:
    return {"PATH": f"{slurm.bin}:{os.environ['PATH']}", "STANDIN": str(slurm.root)}


def _slipway(*args: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("SLIPWAY_", "SBATCH_", "SALLOC_"))}
    return subprocess.run([PY, "-m", "jobs", *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**keep, **env})


def test_slipway_project_and_runs_are_checked_like_config_values(project, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    slurm = StandInSlurm(tmp_path / "slurm")
    submit = ["submit", "tiny_cpu", "data.tokenize_in_job=true"]
    # A mistyped project is refused, never made; a file is no project either.
    for value in (str(project) + "-typo", str(project / "configs" / "tiny_cpu.yaml")):
        r = _slipway("status", env={"SLIPWAY_PROJECT": value}, cwd=elsewhere)
        assert r.returncode == 2 and r.stderr.startswith("slipway: error: $SLIPWAY_PROJECT: ") and \
            r.stderr.count("\n") == 1, r.stderr
        assert not Path(value).exists() or Path(value).is_file()
    # Empty means unset, as in a config: the working directory is the project, its runs/ the runs.
    r = _slipway(*submit, env={**_standin(slurm), "SLIPWAY_PROJECT": "", "SLIPWAY_RUNS": ""}, cwd=project)
    assert r.returncode == 0, r.stderr
    assert (project / "runs" / "tiny_cpu" / "manifest.json").is_file() and not (project / "tiny_cpu").exists()
    # SLIPWAY_RUNS relative to the project, as config paths are; its parent must exist.
    r = _slipway("submit", str(project / "configs" / "tiny_cpu.yaml"), "data.tokenize_in_job=true",
                 env={**_standin(slurm), "SLIPWAY_PROJECT": str(project), "SLIPWAY_RUNS": "team-runs"}, cwd=elsewhere)
    assert r.returncode == 0 and (project / "team-runs" / "tiny_cpu" / "manifest.json").is_file(), r.stderr
    assert list(elsewhere.iterdir()) == []
    r = _slipway(*submit, env={"SLIPWAY_PROJECT": str(project), "SLIPWAY_RUNS": "/nowhere/at/all/runs"}, cwd=project)
    assert r.returncode == 2 and r.stderr.startswith("slipway: error: $SLIPWAY_RUNS: /nowhere/at/all does not exist"), \
        r.stderr
    assert not Path("/nowhere").exists()


# ---------------------------------------------------------------- sbatch's input variables


def _recording_sbatch(slurm: StandInSlurm) -> Path:
    """The stand-in sbatch, saying which SBATCH_* variables it was run with."""
    seen = slurm.root / "sbatch-env"
    body = (slurm.bin / "sbatch").read_text()
    (slurm.bin / "sbatch").write_text(body.replace("#!/bin/bash\n", f'#!/bin/bash\nenv | grep "^SBATCH_" | sort > '
                                                                    f'"{seen}"\n', 1))
    return seen


@pytest.mark.slow
def test_sbatch_variables_that_outrank_the_script_are_cleared_or_refused(project, tmp_path):
    slurm = StandInSlurm(tmp_path / "slurm")
    seen = _recording_sbatch(slurm)
    base = {**_standin(slurm), "SLIPWAY_PROJECT": str(project)}
    outranking = {"SBATCH_TIMELIMIT": "5", "SBATCH_NO_REQUEUE": "1", "SBATCH_JOB_NAME": "other",
                  "SBATCH_OUTPUT": "/tmp/elsewhere-%j.out", "SBATCH_PARTITION": "big", "SBATCH_MEM_PER_CPU": "1G"}
    site = {"SBATCH_RESERVATION": "r1", "SBATCH_ACCOUNT": "a-01", "SBATCH_EXPORT": "ALL"}  # what the script leaves to Slurm
    r = _slipway("submit", "tiny_cpu", "data.tokenize_in_job=true", "slurm.partition=debug", "slurm.mem=2G",
                 env={**base, **outranking, **site}, cwd=project)
    assert r.returncode == 0, r.stderr
    assert seen.read_text().split() == [f"{k}={v}" for k, v in sorted(site.items())]
    warned = r.stderr.splitlines()
    assert len(warned) == len(outranking) and all(w.startswith("slipway: warning: $SBATCH_") for w in warned), r.stderr
    assert "$SBATCH_TIMELIMIT is left out of sbatch's environment: job.sbatch states --time from the run's slurm.time" \
        in r.stderr
    before = tree(project)
    for name, value in (("SBATCH_EXPORT", "NONE"), ("SBATCH_EXPORT", "PATH,HOME"), ("SBATCH_ARRAY_INX", "0-9"),
                        ("SBATCH_WAIT", "1"), ("SBATCH_CLUSTERS", "other"), ("SLURM_CLUSTERS", "other"),
                        ("SBATCH_CONTAINER", "/img"), ("SBATCH_GET_USER_ENV", "1")):
        r = _slipway("submit", "tiny_cpu", "--run-name", "refused", "data.tokenize_in_job=true",
                     env={**base, name: value}, cwd=project)
        assert r.returncode == 2 and r.stderr.startswith(f"slipway: error: ${name}: set in this shell, where ") and \
            r.stderr.count("\n") == 1 and f"unset {name}" in r.stderr, (name, r.stderr)
    assert tree(project) == before


@pytest.mark.slurm
def test_a_real_sbatch_runs_the_job_the_script_states(project, slurm_env):
    """What sbatch itself does with the variables: the job Slurm holds has the run's own time
    limit, name, requeue and output, whatever the shell says."""
    env = {**os.environ, "SLIPWAY_PROJECT": str(project), "SBATCH_TIMELIMIT": "1", "SBATCH_NO_REQUEUE": "1",
           "SBATCH_JOB_NAME": "other", "SBATCH_OPEN_MODE": "truncate"}
    r = _slipway("submit", "tiny_cpu", "data.tokenize_in_job=true", "slurm.time=00:07:00", "slurm.gpus_per_node=0",
                 "--parsable", "launch.launcher=srun", "launch.command=[true]", env=env, cwd=project)
    assert r.returncode == 0, r.stderr
    # The control: the same script sbatched by hand in that shell runs what the variables say.
    plain = subprocess.run(["sbatch", "--parsable", "--hold", str(project / "runs" / "tiny_cpu" / "job.sbatch")],
                           capture_output=True, text=True, env=env, cwd=project).stdout.strip()
    held = {}
    for job in (r.stdout.strip(), plain):
        shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env).stdout
        subprocess.run(["scancel", job], env=env)
        fields = dict(w.split("=", 1) for w in shown.split() if "=" in w)
        held[job] = (fields["TimeLimit"], fields["JobName"], fields["Requeue"])
    assert held == {r.stdout.strip(): ("00:07:00", "tiny_cpu", "1"), plain: ("00:01:00", "other", "0")}, held


# ---------------------------------------------------------------- slurm.mem


@pytest.mark.parametrize("value", ["-5G", "1.5G", "1e30", "''", "5X", "G", "99999999999T", "0x10", " 5G"])
def test_slurm_mem_is_refused_unless_slurm_reads_it(project, value):
    r = _slipway("submit", "tiny_cpu", "--dry-run", f"slurm.mem={value}", env={"SLIPWAY_PROJECT": str(project)},
                 cwd=project)
    assert r.returncode == 2 and r.stderr.startswith("slipway: error: slurm.mem: ") and r.stderr.count("\n") == 1, \
        r.stderr


@pytest.mark.parametrize("value", ["0", "200G", "200000M", "512", "1t", "4096K"])
def test_slurm_mem_in_slurms_grammar_is_written_as_given(project, value):
    r = _slipway("submit", "tiny_cpu", "--dry-run", f"slurm.mem={value}", env={"SLIPWAY_PROJECT": str(project)},
                 cwd=project)
    assert r.returncode == 0 and f"#SBATCH --mem={value}\n" in r.stdout, r.stderr


# ---------------------------------------------------------------- stdout, and the local cluster


@pytest.mark.slow
def test_a_full_or_closed_stdout_is_named_as_such(project):
    env = {"SLIPWAY_PROJECT": str(project)}
    for args in (["status"], ["--help"], ["submit", "tiny_cpu", "--dry-run"]):
        with open("/dev/full", "w") as full:
            r = subprocess.run([PY, "-m", "jobs", *args], cwd=project, stdout=full, stderr=subprocess.PIPE, text=True,
                               timeout=120, env={**os.environ, **env})
        assert r.returncode == 1 and r.stderr == ("slipway: error: stdout: the disk or device it goes to is full: the "
                                                  "output could not be written (not a problem in the config)\n"), \
            (args, r.stderr)
        reader = subprocess.Popen([PY, "-m", "jobs", *args], cwd=project, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env={**os.environ, **env, "COLUMNS": "80"})
        reader.stdout.close()  # the reader ends before slipway writes (`slipway status | head -0`)
        err = reader.stderr.read()
        assert reader.wait(timeout=120) == 1 and "error: stdout: closed before all of it was written" in err \
            and err.count("\n") == 1, (args, err)


def test_cluster_env_says_when_the_cluster_is_another_checkouts():
    from jobs.devcluster.host import RUN_DIR, registry_path
    from jobs.devcluster.spec import CHECKOUT

    if os.geteuid() != 0:
        pytest.skip(f"the local cluster's registry ({RUN_DIR}) is root's")
    name = f"e{os.getpid() % 10_000_000}"
    state = Path("/tmp") / f"slipway-{name}"  # short, as slurm.conf's sockets need; never made
    spec = {"state_dir": str(state), "nodes": 2, "name": name}
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    try:
        for checkout, noted in (("/elsewhere/slipway", True), (str(CHECKOUT), False), (None, True)):
            record = {"state_dir": spec["state_dir"], "spec": spec, "processes": [],
                      **({"checkout": checkout} if checkout else {})}
            registry_path(name).write_text(json.dumps(record))
            r = subprocess.run([PY, "-m", "jobs", "cluster", "env", "--name", name], capture_output=True, text=True,
                               timeout=60)
            assert r.returncode == 0 and r.stdout == f"export SLURM_CONF={state / 'slurm.conf'}\n", r
            if noted:
                assert r.stderr.startswith(f"slipway cluster env: note: cluster '{name}' was started by ") and \
                    (checkout or "did not record its checkout") in r.stderr and str(CHECKOUT) in r.stderr, r.stderr
            else:
                assert r.stderr == "", r.stderr
    finally:
        registry_path(name).unlink(missing_ok=True)
