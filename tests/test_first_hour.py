"""A new user's first hour (issue 21): every command checks what it can before spending time,
a suggested command carries the user's own arguments and works when pasted, and each output
says what happened, once."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
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
    line = one_error_line(slipway("local", *given))
    # Before any process starts (the trainer would find it after 40 s of start-up): the run
    # directory, which a launch writes before it starts a process, was never made.
    assert not (project / "runs").exists()
    assert "the token cache is not prepared: --prepare tokenizes it here first" in line, line
    suggested = shlex.split(re.search(r"`(slipway local [^`]*)` clears it", line).group(1))
    assert suggested[:3] == ["slipway", "local", "tiny_cpu"] and "run.project=my project" in suggested
    assert suggested[-1] == "--prepare" and "--dataset ./corpus" in shlex.join(suggested), suggested
    # Pasted, it prepares here, then meets the next problem, also before any process: this small
    # corpus's 0.1% validation share holds no window of data.seq_len + 1 tokens.
    pasted = slipway(*suggested[1:])
    assert pasted.returncode == 2 and "200 documents" in pasted.stderr, (pasted.stdout, pasted.stderr)  # its progress
    line = pasted.stderr.strip().splitlines()[-1]
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
    suggested = re.search(r"`([^`]*)` clears it", line).group(1)
    assert suggested.startswith(".venv/bin/slipway local tiny_cpu "), line
    pasted = subprocess.run(f"{suggested} --dry-run", shell=True, capture_output=True, text=True, timeout=120,
                            env={**os.environ, **bare})
    assert pasted.returncode == 0 and "verdict: would be started" in pasted.stdout, (pasted.stdout, pasted.stderr)


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
                           "(slipway cluster down stopped it): `unset SLURM_CONF` for this machine's own Slurm, or "
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


@pytest.mark.slow
def test_a_refused_config_change_says_what_changed_and_the_dry_run_says_it_first(project, tmp_path):
    bin_dir = tmp_path / "slurm-bin"
    stand_in(bin_dir, "sbatch", 'echo 4242\n')
    stand_in(bin_dir, "scontrol", 'case "$1" in ping) echo "Slurmctld(primary) at n1 is UP" ;;\n'
                                  '  show) echo "JobId=$4 JobState=COMPLETED ExitCode=0:0" ;; esac\n')
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    assert slipway("submit", "tiny_cpu", env=env).returncode == 0
    line = one_error_line(slipway("submit", "tiny_cpu", "--train-steps", "300", "train.lr=0.001", env=env))
    assert "run tiny_cpu exists with a different config (train.lr 0.003 -> 0.001, train.steps 200 -> 300) in " in line
    r = slipway("submit", "tiny_cpu", "--train-steps", "300", "train.lr=0.001", "--dry-run", env=env)
    head, fix = r.stdout.splitlines()[:7], "`slipway submit tiny_cpu train.lr=0.001 --train-steps 300 --force` clears it"
    assert head[0].startswith("dry run: tiny_cpu (resumes) in ") and head[3].startswith("code: a snapshot"), head
    assert head[4] == "verdict: would be refused (1)", head
    assert head[5].startswith("  - run.name: run tiny_cpu exists with a different config (train.lr 0.003 -> 0.001"), head
    assert head[6] == f"  {fix}", head
    # A refusal exits 2, and says its verdict last as well: 170 lines of script scroll nothing away.
    assert r.returncode == 2 and r.stdout.splitlines()[-3:] == ["dry run: nothing written; would be refused (1)",
                                                                head[5], head[6]], r.stdout.splitlines()[-3:]
    forced = slipway("submit", "tiny_cpu", "--train-steps", "300", "train.lr=0.001", "--dry-run", "--force", env=env)
    assert forced.stdout.splitlines()[4] == "verdict: would be submitted" and forced.returncode == 0, forced.stdout
    pasted = subprocess.run(shlex.split(fix.split("`")[1]), capture_output=True, text=True, timeout=120,
                            env={**os.environ, **env})  # the flag it names, checked before it was printed
    assert pasted.returncode == 0 and "resubmitted tiny_cpu" in pasted.stdout, pasted.stderr


def test_one_interpreter_by_another_of_its_names_is_the_same_config_and_resumes(project, tmp_path):
    """`make local` runs `.venv/bin/python`, the `slipway` script `.venv/bin/python3`: one interpreter,
    recorded by what it is (its directory resolved, its versioned name), so a run sealed under one name
    resumes under the other, and so does one whose config.yaml an older slipway wrote with the alias."""
    venv = Path(sys.executable).parent
    if not ((venv / "python").exists() and (venv / "python3").exists()):
        pytest.skip(f"{venv} lacks python or python3")
    bin_dir = tmp_path / "slurm-bin"
    stand_in(bin_dir, "sbatch", 'echo 4242\n')
    stand_in(bin_dir, "scontrol", 'case "$1" in ping) echo "Slurmctld(primary) at n1 is UP" ;;\n'
                                  '  show) echo "JobId=$4 JobState=COMPLETED ExitCode=0:0" ;; esac\n')
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}

    def submit(python: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(venv / python), "-m", "jobs", "submit", "tiny_cpu"], capture_output=True,
                              text=True, timeout=120, env=env)

    first = submit("python")
    assert first.returncode == 0, first.stderr
    config = project / "runs" / "tiny_cpu" / "config.yaml"
    recorded = re.search(r"^  python: (.+)$", config.read_text(), re.M)[1]
    assert Path(recorded).parent == venv.resolve() and re.fullmatch(r"python\d+\.\d+", Path(recorded).name), recorded
    again = submit("python3")
    assert again.returncode == 0 and "resubmitted tiny_cpu as job 4242" in again.stdout, (again.stdout, again.stderr)
    # As an older slipway wrote it: the alias that ran it.
    config.write_text(config.read_text().replace(f"python: {recorded}", f"python: {venv.resolve() / 'python'}"))
    again = submit("python3")
    assert again.returncode == 0 and "resubmitted tiny_cpu as job 4242" in again.stdout, (again.stdout, again.stderr)


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


@pytest.mark.parametrize("words, said", [
    (["--nodes", "0"], "--nodes: 0: choose 1 to 200"),
    (["--cpus", "0"], "--cpus: 0: give the CPUs each node declares, 1 to 4096"),
    (["--name", "Bad-Name"], "--name: 'Bad-Name': use 1-8 lowercase letters and digits"),
    (["--subnet", "10.1"], "--subnet: '10.1': give the first three octets of a /24"),
    (["--ctld-port", "70000"], "--ctld-port: 70000: give a TCP port"),
    (["--slurmd-port", "6917"], "--slurmd-port: 6917: give a TCP port, 1 to 65535, the controller's and the nodes' apart"),
    (["--timeout", "nan"], "--timeout: nan: give the seconds to wait for idle nodes, more than 0"),
    (["--max-array-size", "0"], "--max-array-size: 0: Slurm takes 1 to 4000001"),
    (["--state-dir", "/tmp/with#hash"], "--state-dir: '/tmp/with#hash' holds a character slurm.conf cannot carry"),
    (["--node-private", "relative/dir"], "--node-private: 'relative/dir': give absolute paths"),
])
def test_cluster_up_says_a_bad_flag_in_one_line_before_anything_starts(words, said, capsys, tmp_path):
    """Bad input to `slipway cluster up`, as to every command: the flag named, exit 2, no daemon started
    and no state written (not `slipway cluster up: ...` and exit 1, as a failed start says)."""
    state = tmp_path / "state"  # and a name of its own: a check that let a case through tears no cluster down
    argv = ["cluster", "up", *words, *([] if "--state-dir" in words else ["--state-dir", str(state)]),
            *([] if "--name" in words else ["--name", "fhbad"])]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"slipway: error: {said}"), lines
    assert not state.exists()


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


# ---------------------------------------------------------------- issue 42: setup decides in seconds


def test_setup_finds_an_unreachable_torch_index_in_seconds_and_says_how_to_choose(tmp_path):
    """`make setup`'s torch index (make torch-index): one that does not answer (here: a server that
    accepts and never replies) is given up after TORCH_PROBE_SECONDS, in one line naming
    TORCH_INDEX; one that answers is used; none is asked for with TORCH_INDEX=."""
    import http.server
    import socket
    import threading

    class Index(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(200 if self.path == "/whl/cpu/torch/" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts, never answers: a firewall that drops, a resolver that hangs
    root = Path(__file__).resolve().parent.parent

    def index(url: str) -> subprocess.CompletedProcess:
        return subprocess.run(["make", "-s", "--no-print-directory", "-C", str(root), "torch-index",
                               f"TORCH_INDEX={url}", "TORCH_PROBE_SECONDS=2"], capture_output=True, text=True,
                              timeout=120)

    try:
        answering = f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
        r = index(answering)
        assert r.returncode == 0 and r.stdout == answering + "\n" and r.stderr == "", (r.stdout, r.stderr)
        for url in (f"http://127.0.0.1:{silent.getsockname()[1]}/whl/cpu",  # no answer
                    "http://name-that-does-not-resolve.invalid/whl/cpu"):  # no name
            r = index(url)
            assert r.returncode == 0 and r.stdout == "", r.stdout  # setup goes on with pip's own indexes
            assert r.stderr == (f"==> {url} does not answer from here (a 2 s probe): torch comes from pip's own "
                                "indexes instead; TORCH_INDEX=URL picks another index, TORCH_INDEX= pip's own "
                                "without the probe\n"), r.stderr
        r = index("")
        assert r.returncode == 0 and r.stdout == "" and r.stderr == ""
    finally:
        server.shutdown()
        silent.close()


# The make this suite may run under (`make test ARGS=...`) passes its command line's variables on to
# every make below it through MAKEFLAGS: the makes these tests run start from a plain shell's.
PLAIN_MAKE_ENV = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}


def test_make_refuses_a_setting_given_as_a_make_variable():
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run(["make", "-C", str(root), "local", "train.steps=50", "CONFIG=tiny_wikitext"],
                       capture_output=True, text=True, timeout=60, env=PLAIN_MAKE_ENV)
    assert r.returncode == 2 and r.stdout.strip().splitlines()[-1:] != ["nothing to train"], r.stdout
    # `make local STEPS=50` is refused too, naming the flag: one door (ARGS) for slipway's settings.
    for given, form, passed in ((["train.steps=50", "CONFIG=tiny_wikitext"], 'make local CONFIG=tiny_wikitext '
                                 'ARGS="train.steps=50"', "-m jobs local tiny_wikitext train.steps=50"),
                                (["STEPS=50"], 'make local ARGS="--train-steps 50"', "-m jobs local tiny_cpu "
                                 "--train-steps 50")):
        r = subprocess.run(["make", "-C", str(root), "local", *given], capture_output=True, text=True, timeout=60, env=PLAIN_MAKE_ENV)
        said = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and f"{given[0]}: make reads no such variable" in said, said
        suggested = said.split("lists its flags): ")[1].removesuffix(".  Stop.")
        assert suggested == form, suggested
        # The form it names passes the setting to slipway (-n: what make would run).
        words = shlex.split(suggested)
        dry = subprocess.run([words[0], "-n", "-C", str(root), *words[1:]], capture_output=True, text=True, timeout=60, env=PLAIN_MAKE_ENV)
        assert dry.returncode == 0 and passed in dry.stdout, dry.stdout


def test_make_accepts_every_variable_it_reads():
    """What make refuses is what no recipe reads: every variable the Makefile defaults (`?=`) or
    `make help` offers ([NAME=...]) passes its check (`make -n help NAME=x`)."""
    root = Path(__file__).resolve().parent.parent
    text = (root / "Makefile").read_text()
    helped = subprocess.run(["make", "-s", "-C", str(root), "help"], capture_output=True, text=True, timeout=60, env=PLAIN_MAKE_ENV).stdout
    names = set(re.findall(r"^([A-Z_]+) *\?=", text, re.M)) | set(re.findall(r"\b([A-Z][A-Z_]+)=", helped))
    assert {"PYXIS_SOURCES", "CONFIG", "ARGS"} <= names, names
    refused = {n: r.stderr for n in sorted(names)
               if (r := subprocess.run(["make", "-n", "-C", str(root), "help", f"{n}=x"], capture_output=True,
                                       text=True, timeout=60, env=PLAIN_MAKE_ENV)).returncode != 0}
    assert not refused, refused


# ---------------------------------------------------------------- issue 42: mistakes told their fix


def test_an_override_in_another_form_is_told_the_key_value_form(project):
    cases = {("train.steps", "100"): "train.steps: an override is KEY=VALUE in one word: train.steps=100",
             ("--nodes", "1", "train.steps", "100"): "train.steps: an override is KEY=VALUE in one word: "
                                                     "train.steps=100",
             ("--train.steps=100",): "--train.steps=100: a config key is set as KEY=VALUE, without dashes: "
                                     "train.steps=100 (or its flag --train-steps 100)",
             ("--train.steps", "100"): "--train.steps: a config key is set as KEY=VALUE, without dashes: "
                                       "train.steps=100 (or its flag --train-steps 100)",
             ("train.stpes=100",): "train.stpes: unknown key; did you mean train.steps or train.dtype? valid keys "
                                   "of train are: steps, "}
    for words, said in cases.items():
        line = one_error_line(slipway("submit", "tiny_cpu", *words, "--dry-run"))
        assert line.startswith(f"slipway: error: {said}"), line
    line = one_error_line(slipway("local", "train.steps=100", "tiny_cpu"))
    assert line == ("slipway: error: CONFIG: train.steps=100 is an override, and the config comes first: CONFIG "
                    "train.steps=100 (e.g. tiny_cpu train.steps=100)"), line
    fixed = slipway("submit", "tiny_cpu", "--nodes", "1", "train.steps=100", "--dry-run")
    assert fixed.returncode == 0 and "verdict: would be" in fixed.stdout, fixed.stderr


def test_a_model_size_that_cannot_take_effect_is_refused(project, tmp_path):
    for words in (["--model-size", "large"], ["model.size=large"]):
        line = one_error_line(slipway("submit", "tiny_cpu", *words, "--dry-run"))
        said = "--model-size large" if words[0] == "--model-size" else "model.size=large"
        assert line.startswith(f"slipway: error: model.size: {said} cannot take effect: configs/tiny_cpu.yaml (with "
                               "the command line) sets every dimension of the model (hidden_size, "), line
    # Where the config leaves the dimensions to the preset, the flag takes effect.
    r = slipway("submit", "tiny_wikitext", "--model-size", "small", "--dry-run", env={"SCRATCH": str(tmp_path)})
    assert r.stderr == "" and "verdict: would be " in r.stdout and "model.size" not in r.stdout, r.stdout


def test_argparse_hints_name_slipway_as_this_shell_runs_it_and_ask_for_no_override(project):
    (project / ".venv").symlink_to(Path(PY).parent.parent)
    bare = {"PATH": os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != Path(PY).parent)}
    for words, command in ((["prepare"], "prepare"), (["local", "tiny_cpu", "--bogus"], "local"), (["bogus"], "")):
        r = subprocess.run([".venv/bin/python", "-m", "jobs", *words], capture_output=True, text=True, timeout=60,
                           env={**os.environ, **bare})
        line = one_error_line(r)
        assert f"(see `.venv/bin/slipway {command + ' ' if command else ''}--help`)" in line, line
        assert "SECTION.KEY=VALUE" not in line  # an override is never required
        help_ = subprocess.run(shlex.split(line.split("`")[1]), capture_output=True, text=True, timeout=60,
                               env={**os.environ, **bare})
        assert help_.returncode == 0 and help_.stdout.startswith("usage: slipway"), help_.stderr


def test_no_config_says_where_slipway_looked_and_which_project_root(tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("SLIPWAY_PROJECT", raising=False)
    line = one_error_line(slipway("submit", "tiny_cpu", "--dry-run"))
    root = Path(__file__).resolve().parent.parent
    assert (f"in the working directory {elsewhere}, which is also the project root (runs/ goes there)" in line
            and line.endswith(f"the checkout slipway runs from has configs/tiny_cpu.yaml: `cd {root}` first")), line
    # The fix, pasted: the same command from there.
    # (A run name of its own: the checkout's runs/ may hold the quick start's tiny_cpu, trained already.)
    r = subprocess.run(f"{line.split('`')[1]} && {shlex.quote(PY)} -m jobs submit tiny_cpu --dry-run "
                       "--run-name pasted-fix", shell=True, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("dry run: pasted-fix"), (r.stdout[:500], r.stderr)
    (tmp_path / "proj").mkdir()
    line = one_error_line(slipway("local", "nope", env={"SLIPWAY_PROJECT": str(tmp_path / "proj")}))
    assert f"the project root, where runs/ goes, is {tmp_path / 'proj'} (SLIPWAY_PROJECT)" in line, line


# ---------------------------------------------------------------- issue 42: a local try that fits


def closed_hub() -> str:
    """A Hugging Face hub that cannot be reached from here: a port nothing listens on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.slow
def test_a_cluster_config_tried_here_says_every_blocker_at_once_and_the_command_that_clears_them(project):
    """tiny_wikitext here (issue 49: memory, then ${SCRATCH}, then the token cache, then the hub, one
    at a time): every blocker in one refusal before anything is written, ${SCRATCH} none of them (a
    try here mounts nothing), and one command that clears them all, checked before it is printed:
    pasted as a dry run, it would start."""
    env = {**{k: v for k, v in os.environ.items() if k != "SCRATCH"}, "HF_ENDPOINT": closed_hub()}
    r = subprocess.run([PY, "-m", "jobs", "local", "tiny_wikitext"], capture_output=True, text=True, timeout=300,
                       env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 4 and all(x.startswith("slipway: error: ") for x in lines), r.stderr
    assert lines[0].startswith("slipway: error: data: the token cache is not prepared, and the Hugging Face hub "
                               "(127.0.0.1) cannot be reached from here"), lines[0]
    assert lines[1].startswith("slipway: error: train.micro_batch_size: 8 processes of about "), lines[1]
    assert lines[2].startswith("slipway: error: train.steps: 1500 steps of ~"), lines[2]
    assert "SCRATCH" not in r.stderr and not (project / "runs").exists()
    fix = shlex.split(lines[3].split("`")[1])
    assert lines[3].endswith("` clears them all") and fix[:3] == ["slipway", "local", "tiny_wikitext"], lines[3]
    assert "--dataset" in fix and "builtin" in fix and "--train-steps" in fix and "--micro-batch-size" in fix, fix
    dry = subprocess.run([*fix, "--dry-run"], capture_output=True, text=True, timeout=300, env=env)
    assert dry.returncode == 0 and "verdict: would be started" in dry.stdout, (dry.stdout, dry.stderr)
    assert dry.stdout.splitlines()[-1] == "dry run: nothing written; would be started", dry.stdout
    # The same refusal as a dry run: each blocker under the verdict, the command, the verdict again.
    r = subprocess.run([PY, "-m", "jobs", "local", "tiny_wikitext", "--dry-run"], capture_output=True, text=True,
                       timeout=300, env=env)
    out = r.stdout.splitlines()
    assert r.returncode == 2 and out[-1] == "dry run: nothing written; would be refused (3)", r.stdout
    # (train.dtype=float32 first where this CPU has no bfloat16 units: local_checks.SLOW_BF16)
    assert "verdict: would be refused (3)" in out and \
        re.match(r"  `slipway local tiny_wikitext (train\.dtype=float32 )?--nodes 1 ", out[-2]), out
    assert out[-2].endswith("` clears them all"), out
    assert not (project / "runs").exists()


def test_the_batch_a_fit_suggests_stays_within_the_configs_own_rules(project):
    """With sequence parallelism over tp 2 a sequence must split in two: the arithmetic's halving
    (200 -> 100 -> 50 -> 25) would propose 25; the suggestion is a command the config takes."""
    from common.layouts import fitting_batch, process_memory
    from jobs.cli.commands import parse
    from jobs.cli.launch import load
    from jobs.local_checks import FIT_SHARE, first_fit

    words = ["tiny_cpu", "--dp", "1", "--tp", "2", "parallel.sequence_parallel=true", "data.seq_len=200"]
    reload = lambda w: load(parse(["local", *w]), quiet=True)  # noqa: E731 (as the pasted command loads)
    cfg = reload(words)
    budget = (process_memory(cfg, 1, 25) + process_memory(cfg, 1, 50)) / 2  # each of the 2 processes
    assert fitting_batch(cfg, budget)[2] == 25  # what the arithmetic alone says
    fit = first_fit(cfg, project / "runs" / "tiny_cpu", reload, None, int(2 * budget / FIT_SHARE))
    assert fit is not None
    chosen = reload(shlex.split(cfg.config_args_setting(fit[0])))  # loads: within the config's rules
    assert chosen.data.seq_len % 2 == 0 and 2 * process_memory(chosen) <= 2 * budget, fit


@pytest.mark.slow
def test_a_long_try_is_asked_about_on_a_terminal(project):
    import pty
    import signal

    def on_a_terminal(answer: bytes) -> tuple[int, str]:
        pid, fd = pty.fork()
        if pid == 0:
            os.execv(PY, [PY, "-m", "jobs", "local", "tiny_cpu", "train.steps=100000000"])
        out, stopped = b"", False
        while b"[y/N]" not in out:
            out += os.read(fd, 4096)
        os.write(fd, answer)
        while True:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
            if answer.startswith(b"y") and b"new run" in out and not stopped:
                os.kill(pid, signal.SIGINT)  # Ctrl-C: started, which is all this test asks
                stopped = True
        text = re.sub(r"\x1b\[[0-9;]*m", "", out.decode(errors="replace"))  # the terminal's colours
        return os.waitpid(pid, 0)[1], text.replace("\r\n", "\n")

    status, out = on_a_terminal(b"n\n")
    assert os.waitstatus_to_exitcode(status) == 2, out
    assert "expected here: ~" in out and "more than a try on this machine (30m00s): a try that fits " in out, out
    assert "; `slipway local tiny_cpu --train-steps " in out and "` clears it\nstart it all the same? [y/N]" in out
    assert "slipway: error: train.steps: not started (nothing written)" in out, out
    assert not (project / "runs").exists()
    status, out = on_a_terminal(b"y\n")
    assert "new run tiny_cpu" in out, out


@pytest.mark.slow
def test_a_try_on_a_machine_with_gpus_is_not_bounded_by_the_cpus_estimate(project, monkeypatch, tmp_path):
    """The trainer takes a GPU when torch sees one (trainer/parallel.py): a long try there is not
    refused by arithmetic made for CPUs, and says its time is not known; CUDA_VISIBLE_DEVICES
    hiding every GPU brings the CPU bound back."""
    from rich.console import Console

    from jobs import interactive, local_checks
    from jobs.cli.commands import parse
    from jobs.cli.launch import load

    cfg = load(parse(["local", "tiny_cpu", "train.steps=100000000"]), quiet=True)
    out = tmp_path / "said.txt"
    with out.open("w") as f, monkeypatch.context() as m:
        m.setattr(local_checks, "gpus_here", lambda: True)
        _, plan = interactive.try_here(cfg, project, force=False, console=Console(file=f, width=300))
    assert plan.blockers == [] and plan.step_s is None
    assert "expected step time here: not known (this machine's GPUs train it" in out.read_text()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not local_checks.gpus_here()
    _, plan = interactive.try_here(cfg, project, force=False, console=Console(file=out.open("w")))
    assert [b.field for b in plan.blockers] == ["train.steps"] and "more than a try on this machine" in plan.lines()[0]


# ---------------------------------------------------------------- issue 42: no silent minute, the end


@pytest.mark.slow
def test_a_launch_silent_for_half_a_minute_says_what_it_waits_for(project):
    (project / "slow.py").write_text("import time\ntime.sleep(25)\nprint('first line', flush=True)\n")
    r = slipway("local", "tiny_cpu", "--dp", "1", "--procs-per-node", "1", "--train-script", "./slow.py",
                "code.snapshot=false", timeout=300)
    assert r.returncode == 0, (r.stdout, r.stderr)
    lines = r.stdout.splitlines()
    assert "expected step time here: not known (train.script or launch.command trains a model of its own)" in lines[0]
    beat = next(i for i, line in enumerate(lines) if "since the launch, waiting for" in line)
    assert beat < lines.index("first line"), lines
    assert "waiting for train.script " in lines[beat], lines[beat]
    assert lines[beat].endswith("slow.py, which has printed nothing (slipway cannot tell its phases)"), lines[beat]
    log = next((project / "runs" / "tiny_cpu" / "logs").glob("local-*.out")).read_text()
    assert f"slipway: {lines[beat]}" in log.splitlines()


def test_a_jobs_log_ends_with_how_the_job_ended(tmp_path):
    """A completed job draws its curves (trainer/plot.py, in the job's container) after its end is
    recorded; a requeue, a saved stop and a failure end the log with three different lines, the
    stop said above what torchrun then reports."""
    ckpt = '"$RUN_DIR/checkpoints/step-000006"'
    save = f"mkdir -p {ckpt} && touch {ckpt}/.metadata {ckpt}/COMPLETE"
    metrics = ("printf '%s\\n' '{\"kind\": \"train\", \"step\": 1, \"loss\": 5.0, \"tokens_per_s\": 10}' "
               "'{\"kind\": \"train\", \"step\": 2, \"loss\": 4.0, \"tokens_per_s\": 12}' > \"$RUN_DIR/metrics.jsonl\"")
    warned = 'kill -USR1 $PPID; sleep 1; echo "torchrun: ChildFailedError: exitcode 75"'
    cases = {"completed": ([], metrics, 0, "slipway: job 41 ended: completed (exit 0)"),
             "requeue": (["slurm.max_requeues=2"], f"{warned}; {save}; exit 1", 0,
                         "slipway: job 41 ended: time-limit requeue 1/2: saved after the stop request (checkpoint at "
                         "step 6), requeueing (exit 0)"),
             "saved": (["slurm.requeue=false"], f"{warned}; {save}; exit 1", 75,
                       "slipway: job 41 ended: time-limit stop: saved after the stop request (checkpoint at step 6); "
                       "slurm.requeue is off (exit 75)"),
             "failed": ([], 'echo "RuntimeError: boom"; exit 1', 1,
                        "slipway: job 41 ended: failed with exit 1: the lines above say why")}
    last = {}
    for name, (overrides, train, code, said) in cases.items():
        job = hang_script.Job(tmp_path / name, *overrides)
        job.script("train.sh", train)
        assert job.run() == code, job.out
        lines = job.out.strip().splitlines()
        assert lines[-1] == said, lines[-3:]
        last[name] = lines[-1]
        if name in ("requeue", "saved"):
            stop = next(i for i, line in enumerate(lines) if line.startswith("slipway: the time limit is near: "))
            assert stop < next(i for i, line in enumerate(lines) if "ChildFailedError" in line)
        if name == "completed":
            curves = job.run_dir / "curves.png"
            assert lines[-2] == f"curves: {curves}" and curves.read_bytes().startswith(b"\x89PNG"), lines[-3:]
    assert len(set(last.values())) == 4


def test_a_cluster_a_newer_slipway_recorded_is_still_read(tmp_path, monkeypatch):
    """The local cluster's registry is machine-wide: a key a newer slipway's `cluster up` recorded
    must not turn every `slipway submit` and `doctor` here into an internal error."""
    import dataclasses

    from jobs.devcluster import ClusterSpec, host
    from jobs.devcluster.spec import spec_of_running

    monkeypatch.setattr(host, "RUN_DIR", tmp_path)
    spec = ClusterSpec(state_dir=Path("/tmp/fhnewer"), nodes=2, name="fhnewer")  # a short name, as slurm.conf needs
    record = {**dataclasses.asdict(spec), "state_dir": str(spec.state_dir), "max_array_size": 1001}
    (tmp_path / "fhnewer.json").write_text(json.dumps({"state_dir": str(spec.state_dir), "spec": record}))
    assert spec_of_running("fhnewer") == spec
    (tmp_path / "fhnewer.json").write_text(json.dumps({"spec": ["damaged"]}))
    assert spec_of_running("fhnewer") is None


# ---------------------------------------------------------------- issue 49: the first hour, third pass


def launch_reading(*args: str, env: dict | None = None):
    """`slipway ARGS` in a session of its own (a terminal's foreground job), its output read line by
    line into a list as it comes (`lines`)."""
    import threading

    from conftest import default_signals

    proc = subprocess.Popen([PY, "-m", "jobs", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=default_signals, env={**os.environ, **(env or {})})
    proc.lines = []  # type: ignore[attr-defined]
    threading.Thread(target=lambda: proc.lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    return proc


def ranks_of(run_dir: Path) -> list[int]:
    """The pids of the run's trainer ranks (its config on their command line, RANK in their environment)."""
    from test_stopping import rank_pid

    return [pid for rank in (0, 1) if (pid := rank_pid(run_dir, rank))]


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_try_slower_than_it_was_said_says_so_with_the_new_total(project):
    """The estimate is checked against the first steps: steps slowed past 1.5x what was said (here
    its ranks are stopped most of the time, as a machine that got busy would) say so, once, with
    the total for the steps left; then Ctrl-C."""
    from test_stopping import SMALL, losses, wait_for

    run_dir = project / "runs" / "pace"
    proc = launch_reading("local", "tiny_cpu", "--run-name", "pace", *SMALL, "train.steps=100000", "--yes")
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").is_file() and len(losses(run_dir)) >= 3, 240, "three steps")
        expected = next(x for x in proc.lines if x.startswith("expected here: ~"))
        deadline = time.monotonic() + 120
        while not any(x.startswith("slower than expected: ") for x in proc.lines) and time.monotonic() < deadline:
            for pid in ranks_of(run_dir):  # each step waits 2 s for its ranks: a machine that got busy
                os.kill(pid, signal.SIGSTOP)
            time.sleep(2)
            for pid in ranks_of(run_dir):
                os.kill(pid, signal.SIGCONT)
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        for pid in ranks_of(run_dir):
            os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    slow = [x for x in proc.lines if x.startswith("slower than expected: ")]
    assert len(slow) == 1, proc.lines[-20:]
    said = re.match(r"slower than expected: ~(\S+) a step here, not the ~(\S+) measured before the start: ~(\S+) "
                    r"for the (\d+) steps left$", slow[0].strip())
    assert said and said[2] in expected and int(said[4]) > 99000, slow[0]


def test_a_stops_grace_is_sized_from_the_runs_steps_and_saves(tmp_path):
    from common.rundir import RunDir, SaveLine
    from jobs.supervisor import STOP_GRACE_SECONDS, stop_grace

    assert stop_grace(tmp_path, 10, 0.5, None) == (STOP_GRACE_SECONDS, "its ~0.5s steps (10 to a sync step), no "
                                                                       "save yet; launch.stop_grace sets it")
    for step, ms in ((100, 30_000), (200, 200_000)):  # the last save's duration counts
        SaveLine(step, ms, 10**9, 145_000, "2026-11-29T00:00:00+00:00").append_to(RunDir(tmp_path).saves)
    grace, why = stop_grace(tmp_path, 1, None, None)  # no step measured yet: the saves' record of it
    assert grace == 2 * (2 * 145 + 200) + 30 and why == "its ~2m25s steps and ~3m20s saves; launch.stop_grace sets it"
    assert stop_grace(tmp_path, 1, 3.0, 600.0) == (600.0, "launch.stop_grace")


@pytest.mark.slow
@pytest.mark.multiproc
def test_train_on_continues_the_learning_rate_it_reached(project):
    """Trained to its min_lr, then on with `--train-steps 40 --force`: the schedule goes on from
    there (train.train_on: decay, from min_lr to min_lr), said by the launch and by the trainer,
    and no step after the checkpoint jumps back up (the old rule re-stretched the cosine: 5x)."""
    from test_stopping import SMALL

    run = project / "runs" / "on"
    first = slipway("local", "tiny_cpu", "--run-name", "on", *SMALL, "train.steps=20", timeout=600)
    assert first.returncode == 0, first.stdout[-3000:]
    on = slipway("local", "tiny_cpu", "--run-name", "on", *SMALL, "--train-steps", "40", "--force", timeout=600)
    assert on.returncode == 0, on.stdout[-3000:]
    assert ("(train.steps 20 -> 40); the learning rate goes on from its value at step 20 and decays (cosine) from "
            "there to train.min_lr 0.0003 at step 40 (train.train_on: decay)") in on.stdout, on.stdout
    assert "train.steps 20 -> 40 at step 20: the learning rate goes on from 3.00e-04, decaying (cosine) to " \
           "3.00e-04 at step 40 (train.train_on)" in on.stdout, on.stdout
    lrs = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "train":
            lrs[record["step"]] = record["lr"]
    assert sorted(lrs) == list(range(1, 41))
    assert all(lrs[s] == pytest.approx(lrs[20]) for s in range(21, 41)), lrs  # step 21 logs the new plan's too


TOKEN = "ghp_" + "aZ3kQ9" * 6  # a GitHub token's form: what a stray paste into a flag's place brings


@pytest.mark.parametrize("module, argv, said", [
    ("jobs.devcluster.command", ["up", "--nodes", TOKEN],
     "slipway: error: argument --nodes: invalid int value: '<hidden>' (see `"),
    ("jobs.devcluster.command", ["upp"], "; did you mean up? (see `"),
    ("trainer.hf", ["exprot"], "python -m trainer.hf: error: argument command: invalid choice: 'exprot' "),
    ("trainer.train", [f"--token={TOKEN}"], "python -m trainer: error: the following arguments are required"),
])
def test_every_entry_points_bad_arguments_are_one_masked_line(module, argv, said, capsys):
    """Not only `slipway`'s own parser: `slipway cluster`, handed its words before that parser, and the
    trainer's modules, started by jobs and by hand, say a bad argument in one line, a secret masked."""
    with pytest.raises(SystemExit) as exit_:
        __import__(module, fromlist=["main"]).main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1 and TOKEN not in lines[0], lines
    assert said in lines[0] and lines[0].endswith(" --help`)"), lines


def test_every_parser_in_the_product_is_the_edges():
    """The class, not the cases above: a module's own argparse.ArgumentParser prints argparse's usage
    block and echoes a pasted secret. pip_requirements.py alone runs in the image build, outside slipway."""
    root = Path(__file__).resolve().parents[1]
    found = [str(p.relative_to(root)) for package in ("common", "jobs", "edf", "containers", "trainer")
             for p in (root / package).rglob("*.py") if "ArgumentParser(" in p.read_text()]
    assert found == ["containers/pip_requirements.py"], found


@pytest.mark.slow
def test_a_misspelt_command_flag_or_key_is_told_the_nearest(project, tmp_path):
    cases = {("lcoal", "tiny_cpu"): "; did you mean local? (see `slipway --help`)",
             ("local", "tiny_cpu", "--train_steps", "5"): "unrecognized arguments: --train_steps 5; did you mean "
                                                          "--train-steps? (see `slipway local --help`)",
             ("submit", "tiny_cpu", "--dryrun"): "; did you mean --dry-run? (see `slipway submit --help`)"}
    for words, said in cases.items():
        line = one_error_line(slipway(*words))
        assert line.endswith(said), line
    (project / "clusters.yaml").write_text("alps:\n  slurm:\n    acount: a-01\n")
    line = one_error_line(slipway("submit", "tiny_cpu", "--cluster", "alps", "--dry-run",
                                  env={"XDG_CONFIG_HOME": str(tmp_path / "xdg")}))
    assert f"{project / 'clusters.yaml'} alps.slurm.acount: line 3: unknown key; did you mean " \
           "alps.slurm.account? " in line, line
    # An unknown key in a config file names the file and the line it is on.
    text = (project / "configs" / "tiny_cpu.yaml").read_text().replace("  steps: 200", "  stpes: 200")
    (project / "configs" / "typo.yaml").write_text(text)
    line = one_error_line(slipway("local", "typo"))
    number = text.splitlines().index("  stpes: 200") + 1
    assert line.startswith(f"slipway: error: train.stpes: configs/typo.yaml line {number}: unknown key; did you mean "
                           "train.steps or train.dtype?"), line
    assert one_error_line(slipway("local", "tiny_cpu", "train.stpes=3")).startswith(
        "slipway: error: train.stpes: unknown key; did you mean")  # on the command line: no file to name


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_second_make_local_names_the_launch_that_holds_the_run(project):
    from test_stopping import SMALL, losses, wait_for

    root, run_dir = Path(__file__).resolve().parent.parent, project / "runs" / "held"
    args = shlex.join(["--run-name", "held", *SMALL, "train.steps=100000", "--yes"])
    proc = launch_reading("local", "tiny_cpu", *shlex.split(args))
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").is_file() and len(losses(run_dir)) >= 1, 240, "a step")
        again = subprocess.run(["make", "-s", "-C", str(root), "local", f"ARGS={args}"], capture_output=True,
                               text=True, timeout=120, env={**os.environ, "SLIPWAY_PROJECT": str(project)})
        assert again.returncode == 2, (again.stdout, again.stderr)
        line = next(x for x in again.stderr.splitlines() if x.startswith("slipway: error: "))
        assert line.startswith("slipway: error: run.name: run held is training: `slipway local tiny_cpu ") and \
            f"(pid {proc.pid} on host " in line, line
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = next((run_dir / "logs").glob("local-*.out")).read_text()
    assert "stopping after step" in log and "to be requeued" not in log  # a local stop is no job's requeue
