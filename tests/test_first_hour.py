"""A new user's first hour (issue 21): every command checks what it can before spending time,
a suggested command carries the user's own arguments and works when pasted, and each output
says what happened, once."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import test_hang_script as hang_script  # its batch-script harness (a module, so its tests stay there)
from conftest import squeue_answering, stand_in
from jobs.cli import main

PY = sys.executable


def slipway(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "jobs", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def one_error_line(r: subprocess.CompletedProcess, code: int = 2) -> str:
    assert r.returncode == code, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("slipway: error: "), r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    return lines[0]


def corpus(project: Path) -> None:
    (project / "corpus").mkdir()
    (project / "corpus" / "a.jsonl").write_text(
        "".join(json.dumps({"body": f"document {i} " * 40}) + "\n" for i in range(200)))


# ---------------------------------------------------------------- slipway local checks first


@pytest.mark.slow
def test_local_refuses_an_unprepared_cache_at_once_and_its_prepare_command_works_pasted(project):
    corpus(project)
    given = ["tiny_cpu", "--dataset", "./corpus", "--text-column", "body", "run.project=my project",
             "data.validation_fraction=0.001"]
    start = time.monotonic()
    line = one_error_line(slipway("local", *given))
    # Before any process starts (the trainer would find it after 40 s of start-up); generous
    # for a loaded machine, far below that.
    assert time.monotonic() - start < 20
    assert not (project / "runs").exists()
    suggested = re.search(r"run `(slipway prepare [^`]*)` first", line).group(1)
    argv = shlex.split(suggested)
    assert argv[:3] == ["slipway", "prepare", "tiny_cpu"] and "run.project=my project" in argv
    assert "--dataset ./corpus" in shlex.join(argv) and "--text-column body" in shlex.join(argv)
    prepared = slipway(*argv[1:])
    assert prepared.returncode == 0 and "200 documents" in prepared.stdout, prepared.stderr
    # Prepared now, the same command meets the next problem, also before any process: this small
    # corpus's 0.1% validation share holds no window of data.seq_len + 1 tokens.
    line = one_error_line(slipway("local", *given))
    assert line.startswith("slipway: error: data.validation_fraction: 0.001 of ") and "set it to 0" in line
    assert not (project / "runs").exists()


def finished(project: Path, run: str = "tiny_cpu", step: int = 200, exist_ok: bool = False) -> Path:
    done = project / "runs" / run / "checkpoints" / f"step-{step:06d}"
    done.mkdir(parents=True, exist_ok=exist_ok)
    for name in (".metadata", "COMPLETE"):  # a whole checkpoint (common/rundir.py checkpoint_complete)
        (done / name).touch()
    return done.parent.parent


def test_local_with_nothing_left_to_train_says_so_before_starting(project):
    run = finished(project)
    r = slipway("local", "tiny_cpu")
    # A complete run is no failure (`make local` again ends without make's "Error 2"): one line, exit 0.
    assert r.returncode == 0 and r.stderr == "", (r.stdout, r.stderr)
    line = r.stdout.strip()
    assert line.startswith("run tiny_cpu already reached train.steps=200 (checkpoint at step 200): nothing to train")
    assert "`slipway local tiny_cpu --train-steps 400 --force`" in line  # a command that works when pasted
    assert not (run / "logs").exists()


def test_submit_refuses_a_run_with_nothing_left_to_train_before_sbatch_by_the_same_rule(project, tmp_path):
    bin_dir, called = tmp_path / "slurm-bin", tmp_path / "sbatch-called"
    stand_in(bin_dir, "sbatch", f'touch {shlex.quote(str(called))}; echo 4242\n')
    stand_in(bin_dir, "scontrol", 'case "$1" in ping) echo "Slurmctld(primary) at n1 is UP" ;;\n'
                                  '  show) echo "JobId=$4 JobState=COMPLETED ExitCode=0:0" ;; esac\n')
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    assert slipway("submit", "tiny_cpu", "--nodes", "1", env=env).returncode == 0
    called.unlink()
    finished(project, exist_ok=True)  # the job trained all its steps
    line = one_error_line(slipway("submit", "tiny_cpu", "--nodes", "1", env=env))
    assert line.startswith("slipway: error: train.steps: run tiny_cpu already reached train.steps=200 (checkpoint "
                           "at step 200): nothing to train"), line
    assert "`slipway submit tiny_cpu --nodes 1 --train-steps 400 --force`" in line
    assert not (tmp_path / "sbatch-called").exists()
    local = slipway("local", "tiny_cpu", env=env).stdout
    assert line.split("nothing to train")[1].replace("submit tiny_cpu --nodes 1", "local tiny_cpu") == \
        local.split("nothing to train")[1].strip()  # the same rule, the same hint
    # The hint pasted: a changed config, kept in history/; sbatch is called this time.
    r = subprocess.run(shlex.split(line.split("`")[1]), capture_output=True, text=True, timeout=120,
                       env={**os.environ, **env})
    assert r.returncode == 0 and called.exists() and "resubmitted" in r.stdout, (r.stdout, r.stderr)
    assert list((project / "runs" / "tiny_cpu" / "history").iterdir())


@pytest.mark.slow
def test_a_hint_names_slipway_as_the_shell_make_setup_leaves_runs_it(project):
    """After `make setup` slipway is `.venv/bin/slipway`, not on PATH: a hint says so, and pasted it works."""
    (project / ".venv").symlink_to(Path(PY).parent.parent)  # this project's venv, as `make setup` makes it
    corpus(project)
    bare = {"PATH": os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != Path(PY).parent)}
    given = ["tiny_cpu", "--dataset", "./corpus", "--text-column", "body", "data.validation_fraction=0"]
    r = subprocess.run([".venv/bin/python", "-m", "jobs", "local", *given], capture_output=True, text=True,
                       timeout=120, env={**os.environ, **bare})
    line = one_error_line(r)
    suggested = re.search(r"run `([^`]*)` first", line).group(1)
    assert suggested.startswith(".venv/bin/slipway prepare tiny_cpu "), line
    pasted = subprocess.run(shlex.split(suggested), capture_output=True, text=True, timeout=120,
                            env={**os.environ, **bare})
    assert pasted.returncode == 0 and "200 documents" in pasted.stdout, (pasted.stdout, pasted.stderr)


@pytest.fixture
def hub_without_it():
    """A stand-in for the Hugging Face hub (it cannot be reached from here) that knows no repository:
    404 RepoNotFound, as the hub answers for a misspelt name; its URL for HF_ENDPOINT."""
    import http.server
    import threading

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            body = b'{"error": "Repository not found"}'
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(body)

        do_GET = do_HEAD

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.slow
def test_a_misspelt_dataset_is_one_line_in_seconds_whether_the_hub_answers_or_not(project, hub_without_it):
    import socket

    with socket.socket() as s:  # a port nothing listens on: a hub this machine cannot reach
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    for endpoint, said in ((closed, "the Hugging Face hub (127.0.0.1) cannot be reached from here"),
                           (hub_without_it, "Dataset 'wikitxt' doesn't exist on the Hub")):
        r = slipway("prepare", "tiny_cpu", "--dataset", "wikitxt", "--text-column", "text",
                    env={"HF_ENDPOINT": endpoint, "HF_HOME": str(project / "hf")})
        line = one_error_line(r)
        assert line.startswith("slipway: error: data.dataset: ") and said in line and "check the name" in line, line
        assert "Retrying" not in r.stdout + r.stderr  # the hub client's retries say so; none is made


def test_local_help_shows_only_the_flags_of_a_local_run(capsys):
    with pytest.raises(SystemExit):
        main(["local", "--help"])
    local = capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["submit", "--help"])
    submit = capsys.readouterr().out
    for flag in ("--partition", "--account", "--qos", "--time", "--email", "--runtime", "--image", "--launcher",
                 "--cpus-per-task"):
        assert flag in submit and flag not in local, flag
    for flag in ("--train-steps", "--dataset", "--tp", "--nodes", "--procs-per-node", "--run-name"):
        assert flag in local, flag


# ---------------------------------------------------------------- slipway submit


def test_submit_without_a_controller_is_doctors_one_line_and_writes_nothing(project, tmp_path):
    if shutil.which("scontrol") is None:
        pytest.skip("needs Slurm's scontrol, which says why no controller answers")
    env = {"SLURM_CONF": str(tmp_path / "no-such" / "slurm.conf")}
    line = one_error_line(slipway("submit", "tiny_cpu", env=env), code=1)
    assert "no Slurm controller answers, so sbatch would fail; check SLURM_CONF" in line
    doctor = slipway("doctor", env=env)
    assert line.removeprefix("slipway: error: ") in doctor.stdout  # one diagnosis, the same words
    assert not (project / "runs").exists()


def test_a_slurm_conf_left_from_a_stopped_local_cluster_is_named_first(project, tmp_path):
    if shutil.which("scontrol") is None:
        pytest.skip("needs Slurm's scontrol, which says why no controller answers")
    from jobs.devcluster import ClusterSpec, render_slurm_conf

    spec = ClusterSpec(state_dir=Path("/tmp/slipway-gone"), nodes=2)  # a short name, as slurm.conf needs
    conf = tmp_path / "slurm.conf"  # its conf as `slipway cluster down` leaves it
    conf.write_text(render_slurm_conf(spec))
    line = one_error_line(slipway("submit", "tiny_cpu", env={"SLURM_CONF": str(conf)}), code=1)
    assert line.startswith(f"slipway: error: SLURM_CONF={shlex.quote(str(conf))} names a local test cluster that is not up "
                           "(`slipway cluster down` stopped it): `unset SLURM_CONF` for this machine's own Slurm, or "
                           "`slipway cluster up`"), line
    assert len(line) < 600, line  # scontrol's page of munge errors cut short, after the fix
    assert not (project / "runs").exists()


def test_submit_parsable_prints_only_the_job_id(project, tmp_path):
    bin_dir = tmp_path / "slurm-bin"
    stand_in(bin_dir, "sbatch", 'echo 4242\n')
    stand_in(bin_dir, "scontrol", '[ "$1" = ping ] && echo "Slurmctld(primary) at n1 is UP"\n')
    stand_in(bin_dir, "squeue", squeue_answering("PENDING"))
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    r = slipway("submit", "tiny_cpu", "--parsable", env=env)
    assert r.returncode == 0 and r.stdout == "4242\n", (r.stdout, r.stderr)
    assert "submitted tiny_cpu as job 4242" in r.stderr
    r = slipway("submit", "tiny_cpu", "--run-name", "again", env=env)
    assert r.returncode == 0 and "submitted again as job 4242" in r.stdout
    assert r.stdout.strip().splitlines()[-1] != "4242"  # no bare id line for a person to wonder about


def test_a_refused_config_change_says_what_changed_and_the_dry_run_says_it_first(project, tmp_path):
    bin_dir = tmp_path / "slurm-bin"
    stand_in(bin_dir, "sbatch", 'echo 4242\n')
    stand_in(bin_dir, "scontrol", 'case "$1" in ping) echo "Slurmctld(primary) at n1 is UP" ;;\n'
                                  '  show) echo "JobId=$4 JobState=COMPLETED ExitCode=0:0" ;; esac\n')
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    assert slipway("submit", "tiny_cpu", env=env).returncode == 0
    line = one_error_line(slipway("submit", "tiny_cpu", "--train-steps", "300", "train.lr=0.001", env=env))
    assert "run tiny_cpu exists with a different config (train.lr 0.003 -> 0.001, train.steps 200 -> 300) in " in line
    dry = slipway("submit", "tiny_cpu", "--train-steps", "300", "train.lr=0.001", "--dry-run", env=env).stdout
    head = dry.splitlines()[:6]
    assert head[0].startswith("dry run: tiny_cpu (resumes) in ") and head[3].startswith("code: a snapshot"), head
    assert head[4] == "verdict: would be refused (1)", head
    assert head[5].startswith("  - run.name: run tiny_cpu exists with a different config (train.lr 0.003 -> 0.001"), head
    assert dry.splitlines()[-1] == ("dry run: nothing written, nothing submitted; would be refused (1) (the reasons "
                                    "are at the top)")
    forced = slipway("submit", "tiny_cpu", "--train-steps", "300", "train.lr=0.001", "--dry-run", "--force", env=env)
    assert forced.stdout.splitlines()[4] == "verdict: would be submitted", forced.stdout


def test_a_refused_submission_suggests_prepare_with_the_users_own_arguments(project, tmp_path):
    corpus(project)
    r = slipway("submit", "tiny_cpu", "data.text_column=body", "--dataset", "./corpus", "--nodes", "1",
                "--dry-run")
    assert "verdict: would be refused" in r.stdout.splitlines()[4], r.stdout  # the verdict before the files
    note = next(line for line in r.stdout.splitlines() if line.startswith("  - data: "))
    assert "`slipway prepare tiny_cpu data.text_column=body --nodes 1 --dataset ./corpus`" in note


# ---------------------------------------------------------------- doctor, image, cluster


def test_doctor_says_each_problem_once(project):
    env = {k: v for k, v in os.environ.items() if k != "FIRST_HOUR_UNSET"}
    r = subprocess.run([PY, "-m", "jobs", "doctor", "tiny_cpu", "container.runtime=edf",
                        "container.mounts=[${FIRST_HOUR_UNSET}:/data]"], capture_output=True, text=True,
                       timeout=120, env=env)
    said = [line for line in r.stdout.splitlines() if "FIRST_HOUR_UNSET" in line]
    assert len(said) == 1 and said[0].startswith("fail mounts and files, "), r.stdout
    assert r.returncode == 1


def test_image_help_names_the_command_the_user_typed(capsys):
    with pytest.raises(SystemExit):
        main(["image", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: slipway image ") and "python -m containers" not in out


def test_cluster_down_says_what_it_stopped(capsys):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("the local cluster's commands run as root, with iproute2")
    assert main(["cluster", "down", "--name", "fhnone"]) == 0
    assert capsys.readouterr().out == "no cluster 'fhnone' was running: nothing to stop\n"


# ---------------------------------------------------------------- the time-limit save's event


@pytest.mark.parametrize("saves", [True, False])
def test_time_limit_stop_under_torchrun_says_what_the_trainer_did(tmp_path, saves):
    """torchrun exits 1 when the trainer exits 75 (saved, requeue me): the event reads the
    trainer's checkpoints, not that code."""
    job = hang_script.Job(tmp_path, "slurm.max_requeues=2")
    ckpt = '"$RUN_DIR/checkpoints/step-00000{0}"'
    job.script("train.sh", "\n".join([
        f"mkdir -p {ckpt.format(4)} && touch {ckpt.format(4)}/.metadata {ckpt.format(4)}/COMPLETE",
        "kill -USR1 $PPID; sleep 1",  # the batch script: Slurm's warning before the time limit
        *([f"mkdir -p {ckpt.format(6)} && touch {ckpt.format(6)}/.metadata {ckpt.format(6)}/COMPLETE"] if saves else []),
        "exit 1"]))
    assert job.run() == 0, job.out
    events = job.events()
    assert "time limit warning: stop requested" in events, events
    want = ("saved after the stop request (checkpoint at step 6)" if saves
            else "no checkpoint saved after the stop request (step exit 1)")
    assert f"time-limit requeue 1/2: {want}, requeueing" in events, events


# ---------------------------------------------------------------- status and watch as a newcomer sees them


TINY_FAST = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=4",
             "model.num_kv_heads=2", "data.seq_len=64", "model.max_position_embeddings=64", "train.micro_batch_size=4",
             "train.eval_interval=0", "train.warmup_steps=2", "logging.interval=1", "checkpoint.interval=1000"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_status_fits_80_columns_and_watch_into_a_pipe_shows_the_run_as_it_goes(project):
    launcher = subprocess.Popen([PY, "-m", "jobs", "local", "tiny_cpu", "--run-name", "a-longer-run-name", *TINY_FAST,
                                 "train.steps=300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        metrics = project / "runs" / "a-longer-run-name" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.is_file() and metrics.stat().st_size) and time.monotonic() < deadline:
            time.sleep(0.2)
        # Piped, the view is printed as it goes, not only once the run has ended.
        watch = subprocess.Popen([PY, "-m", "jobs", "watch", "a-longer-run-name"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        first = watch.stdout.readline()
        assert first.startswith("run a-longer-run-name  job local  RUNNING"), first
        assert launcher.poll() is None  # while it still trains
        out = first + watch.communicate(timeout=300)[0]
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()
    assert watch.returncode == 0 and out.count("run a-longer-run-name  job local") >= 2, out
    assert out.strip().splitlines()[-1] == "job local ended: COMPLETED, exit code 0", out
    status = slipway("status", env={"COLUMNS": "80"}).stdout
    assert max(map(len, status.splitlines())) <= 80, status
    row = next(line for line in status.splitlines() if "a-longer-run-name" in line)
    assert "COMPLETED" in row and "step 300/300, loss " in row, status  # the name whole, the progress on one line
