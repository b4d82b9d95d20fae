"""Every suggestion works as printed (issue 42): each `slipway ...` command the product can print
in backticks is made to be printed by a test here, through the command line, and then pasted into a
fresh shell of the kind `make setup` leaves a user in (slipway is `.venv/bin/slipway`, not on
PATH; the project's directory), where it must do what the hint says.

`test_every_hint_is_pasted_by_a_test_here` finds the hints in the product's sources (string
literals that reach a user, not comments or docstrings) and holds the tests below to claim each,
so a hint added without a test that pastes it fails here. Slurm, podman and enroot are stood in
(tests/conftest.py `stand_in`, tests/image_standins.py) where the pasted command would otherwise
need a cluster; `slipway cluster up` is pasted where Slurm's daemons are out of PATH, so it gets as
far as naming them (starting a real cluster is tests/test_cluster.py's)."""

from __future__ import annotations

import ast
import collections
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

from conftest import ROOT, default_signals, squeue_answering, stand_in
from image_standins import write_standins
from test_first_hour import hub_without_it  # noqa: F401 (a fixture: a hub that knows no repository)
from test_pinned import PYXIS, fake_build, pin_config  # noqa: F401 (a fixture)

PY = sys.executable
VENV = Path(PY).parent.parent
PRODUCT = ("jobs", "common", "edf", "containers", "trainer")
# A backticked command of slipway's, as the sources write it (`slipway`, or the invocation itself).
_HINT = re.compile(r"`((?:slipway|\{[a-z_.]*invocation\(\)\}|\{prog\}) [^`]*)`")

COVERED: list[str] = []  # "path: template", once per place the product prints it


def covers(*sites: str):
    COVERED.extend(sites)
    return lambda test: test


def product_hints() -> list[str]:
    """Every backticked slipway command in a string of the product that is no docstring and no
    comment of a script it writes ("# ..."), as "path: template"."""
    found = []
    for root in PRODUCT:
        for path in sorted((ROOT / root).rglob("*.py")):
            tree = ast.parse(path.read_text())
            skip = {id(node.body[0].value) for node in ast.walk(tree)
                    if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    and node.body and isinstance(node.body[0], ast.Expr)
                    and isinstance(node.body[0].value, ast.Constant)}
            texts = []
            for node in ast.walk(tree):
                if isinstance(node, ast.JoinedStr):
                    skip.update(id(v) for v in node.values)
                    texts.append("".join(v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
                                         for v in node.values))
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                    texts.append(node.value)
            rel = path.relative_to(ROOT)
            found += [f"{rel}: {m.group(1)}" for text in texts if not text.startswith("#")
                      for m in _HINT.finditer(text)]
    return found


# ---------------------------------------------------------------- the shell a user pastes into


@pytest.fixture
def shell(project: Path, tmp_path: Path) -> dict:
    """The environment of a shell `make setup` leaves: `.venv` in the project, not on PATH."""
    (project / ".venv").symlink_to(VENV)
    path = [p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != Path(PY).parent]
    return {**os.environ, "PATH": os.pathsep.join(path), "COLUMNS": "300"}


# slipway as the user runs it after `make setup` (whose `.venv/bin/slipway` runs this interpreter)
SLIPWAY = [".venv/bin/python", "-m", "jobs"]


def slipway(shell: dict, *args: str, extra: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*SLIPWAY, *args], capture_output=True, text=True, timeout=timeout,
                          env={**shell, **(extra or {})})


def pasted(command: str, shell: dict, extra: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`command` as a user pastes it: a fresh bash in the project, the same kind of environment."""
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=timeout,
                          env={**shell, **(extra or {})})


def hint(text: str, words: str) -> str:
    """The backticked command in `text` that runs `slipway WORDS ...` as this shell must: the
    venv's slipway by its path (bare `slipway` is not on this PATH)."""
    found = [h for h in re.findall(r"`([^`]+)`", text)
             if re.match(rf"\S*/slipway {re.escape(words)}( |$)", h) and Path(shlex.split(h)[0]).name == "slipway"]
    assert found, f"no `.../slipway {words} ...` in: {text}"
    return found[0]


def slurm(tmp_path: Path, shell: dict, state: str = "COMPLETED") -> dict:
    """sbatch, scontrol, squeue and scancel stand-ins: job ids from 4242 on, every job in the state
    the file `state` holds (scancel makes it CANCELLED)."""
    bin_dir, state_file, last = tmp_path / "slurm-bin", tmp_path / "job-state", tmp_path / "last-job"
    state_file.write_text(state)
    stand_in(bin_dir, "sbatch", f'n=$(( $(cat {shlex.quote(str(last))} 2>/dev/null || echo 4241) + 1 )); '
                                f'echo "$n" > {shlex.quote(str(last))}; echo "$n"\n')
    stand_in(bin_dir, "scontrol", 'case "$1" in ping) echo "Slurmctld(primary) at n1 is UP" ;;\n'
                                  f'  show) echo "JobId=$4 JobState=$(cat {shlex.quote(str(state_file))}) '
                                  'ExitCode=0:0" ;; esac\nexit 0\n')
    stand_in(bin_dir, "squeue", squeue_answering(f"$(cat {shlex.quote(str(state_file))})"))
    stand_in(bin_dir, "scancel", f"echo CANCELLED > {shlex.quote(str(state_file))}\n")
    return {"PATH": f"{bin_dir}{os.pathsep}{shell['PATH']}", "_STATE": str(state_file)}


def without_slurm_daemons(tmp_path: Path, shell: dict, *more: str) -> dict:
    """PATH with every command of the shell's but Slurm's own (client and daemons), ip and `more`:
    where slipway finds no Slurm, and `slipway cluster up` stops at naming what it lacks."""
    bin_dir = tmp_path / f"no-slurm-bin{'-' if more else ''}{'-'.join(more)}"
    bin_dir.mkdir()
    hidden = {"sbatch", "srun", "squeue", "scontrol", "sinfo", "sacct", "scancel", "slurmctld", "slurmd", "munged",
              "ip", *more}
    for directory in shell["PATH"].split(os.pathsep):
        for tool in Path(directory).glob("*") if Path(directory).is_dir() else ():
            if tool.name not in hidden and not (bin_dir / tool.name).exists():
                (bin_dir / tool.name).symlink_to(tool)
    return {"PATH": str(bin_dir)}


def corpus(project: Path) -> None:
    (project / "corpus").mkdir()
    (project / "corpus" / "a.jsonl").write_text(
        "".join(json.dumps({"body": f"document {i} " * 40}) + "\n" for i in range(200)))


# A model of seconds a step or less, logged every step.
SMALL = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "data.seq_len=64", "model.max_position_embeddings=64", "train.micro_batch_size=4",
         "train.eval_interval=0", "train.warmup_steps=2", "logging.interval=1", "checkpoint.interval=1000"]


# ---------------------------------------------------------------- the registry


def test_every_hint_is_pasted_by_a_test_here():
    found, claimed = collections.Counter(product_hints()), collections.Counter(COVERED)
    assert not found - claimed, f"hints no test here pastes: {sorted(found - claimed)}"
    assert not claimed - found, f"claimed here, not in the product (changed?): {sorted(claimed - found)}"


# ---------------------------------------------------------------- submit, prepare, cancel


@covers("jobs/runs/submit.py: {environ.invocation()} {command} {more} --force")
def test_train_on_a_finished_run(project, shell, tmp_path):
    env = slurm(tmp_path, shell)
    assert slipway(shell, "submit", "tiny_cpu", "--nodes", "1", extra=env).returncode == 0
    done = project / "runs" / "tiny_cpu" / "checkpoints" / "step-000200"
    done.mkdir(parents=True)
    for name in (".metadata", "COMPLETE"):
        (done / name).touch()
    r = slipway(shell, "submit", "tiny_cpu", "--nodes", "1", extra=env)
    assert r.returncode == 2
    again = pasted(hint(r.stderr, "submit"), shell, env)
    assert again.returncode == 0 and "resubmitted tiny_cpu" in again.stdout, again.stderr
    replaced = next(line for line in again.stdout.splitlines() if line.startswith("config replaced (--force): "))
    assert ("(train.steps 200 -> 400); the learning rate goes on from its value at step 200 and decays (cosine) from "
            "there to train.min_lr 0.0003 at step 400 (train.train_on: decay); the old one is in ") in replaced, replaced
    assert Path(replaced.split("the old one is in ")[1]).read_text().count("steps: 200") == 1


@covers("jobs/runs/submit.py: slipway cancel {cfg.run.name}")
def test_cancel_a_job_that_holds_the_run(project, shell, tmp_path):
    env = slurm(tmp_path, shell, "RUNNING")
    assert slipway(shell, "submit", "tiny_cpu", extra=env).returncode == 0
    r = slipway(shell, "submit", "tiny_cpu", "--train-steps", "300", extra=env)
    assert r.returncode == 2 and "has a job queued or running" in r.stderr
    cancel = pasted(hint(r.stderr, "cancel"), shell, env)
    assert cancel.returncode == 0 and "cancelled 4242" in cancel.stdout, (cancel.stdout, cancel.stderr)


@pytest.mark.slow
@covers("jobs/cli/launch.py: {invocation()} submit {cfg.config_args}",
        "jobs/cli/launch.py: {invocation()} submit {cfg.config_args}")
def test_submit_after_prepare_here_and_as_a_job(project, shell, tmp_path):
    env = slurm(tmp_path, shell, "RUNNING")
    r = slipway(shell, "prepare", "tiny_cpu", "--as-job", extra=env)
    assert r.returncode == 0, r.stderr
    Path(env["_STATE"]).write_text("COMPLETED")  # "once it has completed"
    submitted = pasted(hint(r.stdout, "submit"), shell, env)
    assert submitted.returncode == 0 and "submitted tiny_cpu as job 4243" in submitted.stdout, submitted.stderr

    r = slipway(shell, "prepare", "tiny_cpu", "--run-name", "here")
    assert r.returncode == 0 and "prepared" in r.stdout, r.stderr
    submitted = pasted(hint(r.stdout, "submit"), shell, env)
    assert submitted.returncode == 0 and "submitted here as job 4244" in submitted.stdout, submitted.stderr


@pytest.mark.slow
@covers("jobs/runs/submit.py: slipway prepare {config_args}")
def test_prepare_an_unprepared_cache(project, shell, tmp_path):
    corpus(project)
    given = ["tiny_cpu", "--dataset", "./corpus", "--text-column", "body", "data.validation_fraction=0"]
    # A try here: --prepare prepares it first (a dry run of the command it names would start).
    r = slipway(shell, "local", *given, "--run-name", "here")
    assert r.returncode == 2 and "the token cache is not prepared: --prepare tokenizes it here first" in r.stderr
    dry = pasted(f"{hint(r.stderr, 'local')} --dry-run", shell)
    assert dry.returncode == 0 and dry.stdout.splitlines()[-1] == "dry run: nothing written; would be started", dry
    r = slipway(shell, "submit", *given, extra=slurm(tmp_path, shell))
    assert r.returncode == 2 and "the token cache is not prepared" in r.stderr
    prepared = pasted(hint(r.stderr, "prepare"), shell)
    assert prepared.returncode == 0 and "200 documents" in prepared.stdout, prepared.stderr


@pytest.mark.slow
@covers("jobs/cli/logs.py: slipway submit {shlex.quote(str(run.paths.config))}",
        "jobs/cli/watch.py: slipway submit {shlex.quote(str(run.paths.config))}")
def test_submit_a_run_that_has_no_job(project, shell, tmp_path):
    env = slurm(tmp_path, shell)
    assert slipway(shell, "submit", "tiny_cpu", extra=env).returncode == 0
    manifest = project / "runs" / "tiny_cpu" / "manifest.json"  # its record of the job lost (damaged state)
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "submissions": []}))
    for command in ("logs", "watch"):
        r = slipway(shell, command, "tiny_cpu", extra=env)
        assert r.returncode == 2 and "has no job" in r.stderr, r.stderr
        submitted = pasted(hint(r.stderr, "submit"), shell, env)
        assert submitted.returncode == 0 and "submitted tiny_cpu as job " in submitted.stdout, submitted.stderr
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "submissions": []}))


@covers("jobs/cli/logs.py: slipway status {pasteable(run.name)}")
def test_status_lists_the_jobs_when_another_is_named(project, shell, tmp_path):
    env = slurm(tmp_path, shell, "RUNNING")
    assert slipway(shell, "submit", "tiny_cpu", extra=env).returncode == 0
    r = slipway(shell, "logs", "tiny_cpu", "--job", "4141", extra=env)
    assert r.returncode == 2 and "run tiny_cpu has no job 4141: its jobs are 4242 (`" in r.stderr, r.stderr
    listed = pasted(hint(r.stderr, "status"), shell, env)
    assert listed.returncode == 0 and "4242" in listed.stdout, (listed.stdout, listed.stderr)


@covers("jobs/cli/watch.py: slipway cancel {run.name}")
def test_cancel_after_watching(project, shell, tmp_path):
    env = slurm(tmp_path, shell, "RUNNING")
    assert slipway(shell, "submit", "tiny_cpu", extra=env).returncode == 0
    watch = subprocess.Popen([*SLIPWAY, "watch", "tiny_cpu"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env={**shell, **env}, start_new_session=True,
                             preexec_fn=default_signals)
    try:
        assert watch.stdout.readline().startswith("run tiny_cpu  job 4242")
        os.killpg(watch.pid, signal.SIGINT)
        out = watch.communicate(timeout=60)[0]
    finally:
        if watch.poll() is None:
            os.killpg(watch.pid, signal.SIGKILL)
    assert watch.returncode == 130, out
    cancel = pasted(hint(out, "cancel"), shell, env)
    assert cancel.returncode == 0 and "cancelled 4242" in cancel.stdout, (cancel.stdout, cancel.stderr)


@covers("jobs/interactive.py: slipway submit {cfg.config_args}")
def test_submit_instead_of_running_outside_an_allocation(project, shell, tmp_path):
    env = slurm(tmp_path, shell)
    r = slipway(shell, "run", "tiny_cpu", "--nodes", "1", extra={**env, "SLURM_JOB_ID": ""})
    assert r.returncode == 2 and "not inside a Slurm allocation" in r.stderr
    submitted = pasted(hint(r.stderr, "submit"), shell, env)
    assert submitted.returncode == 0 and "submitted tiny_cpu as job 4242" in submitted.stdout, submitted.stderr


@pytest.mark.slow
@covers("jobs/cli/sweep.py: slipway status {name}", "jobs/cli/sweep.py: slipway compare {name}",
        "jobs/runs/sweep.py: slipway status")
def test_a_sweeps_commands(project, shell, tmp_path):
    from slurm_standin import StandInSlurm

    env = StandInSlurm(tmp_path / "slurm").env(shell)
    r = slipway(shell, "sweep", "tiny_cpu", "--name", "g", "train.lr=[1e-3, 3e-3]", extra=env)
    assert r.returncode == 0 and "submitted array" in r.stdout, r.stderr
    status = pasted(hint(r.stdout, "status"), shell, env)
    assert status.returncode == 0 and status.stdout.startswith("sweep g: 2 point(s)"), (status.stdout, status.stderr)
    compare = pasted(hint(r.stdout, "compare"), shell, env)
    assert compare.returncode == 0 and compare.stdout.startswith("2 run(s) by eval loss"), compare.stderr
    (project / "runs" / ".sweeps" / "g" / "sweep.json").write_text("{")  # the sweep's record damaged
    r = slipway(shell, "status", "g", extra=env)
    assert r.returncode == 2 and "its points stay runs of their own" in r.stderr, r.stderr
    listed = pasted(hint(r.stderr, "status"), shell, env)
    assert "g-lr1e-3" in listed.stdout and "g-lr3e-3" in listed.stdout, (listed.stdout, listed.stderr)


@pytest.mark.slow
@covers("jobs/slurm/bad_nodes.py: slipway nodes{forgetting(self.cluster, [name])}",
        "jobs/slurm/bad_nodes.py: slipway nodes{forgetting(remembered.cluster, out.nodes)}")
def test_a_clusters_remembered_bad_nodes_forgotten(project, shell, tmp_path):
    from jobs.slurm.bad_nodes import BadNode

    (project / "clusters.yaml").write_text("alps:\n  slurm: {partition: normal}\n")
    memory = project / "runs" / ".nodes" / "alps"
    memory.mkdir(parents=True)
    now = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    (memory / "nid001").write_text(BadNode("nid001", now, now, "r", "41", "preflight", "preflight fail: no GPU").line()
                                   + "\n")
    (memory / "nid004").write_text("half a rec")
    shell = {**shell, "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    r = slipway(shell, "nodes", "--cluster", "alps")
    assert r.returncode == 0 and "nid004: not a bad node's record" in r.stdout, r.stdout
    forgot = pasted(hint(r.stdout, "nodes"), shell)
    assert forgot.stdout == "forgot nid004 (cluster alps)\n", (forgot.stdout, forgot.stderr)
    env = slurm(tmp_path, shell)
    stand_in(Path(env["PATH"].split(os.pathsep)[0]), "sinfo", "printf 'nid001|idle|normal*\\nnid002|idle|normal\\n'\n")
    r = slipway(shell, "submit", "tiny_cpu", "--cluster", "alps", extra=env)
    assert r.returncode == 0 and "excluding the bad nodes cluster alps remembers: nid001" in r.stdout, r.stderr
    forgot = pasted(hint(r.stdout, "nodes"), shell)
    assert forgot.stdout == "forgot nid001 (cluster alps)\n", (forgot.stdout, forgot.stderr)
    assert not any(memory.iterdir())


@pytest.mark.slow
@covers("jobs/slurm/bad_nodes.py: slipway nodes{forgetting(self.cluster, [name])}")
def test_every_forget_hint_of_a_hostile_record_forgets_it_when_pasted(project, shell, tmp_path):
    """Records named, or naming a node, with control and bidirectional characters, and one dated
    in the future (it would exclude its node until then): each is one line whose `--forget` hint,
    pasted, removes it; none is taken for a live bad node."""
    from jobs.slurm.bad_nodes import BadNode

    (project / "clusters.yaml").write_text("alps:\n  slurm: {partition: normal}\n")
    memory = project / "runs" / ".nodes" / "alps"
    memory.mkdir(parents=True)
    now = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    hostile = {"n\x1bode": "half a rec", "nid\u202e7\x07": BadNode("nid7", now, now, "r", "41", "hang", "x").line(),
               "nid8": BadNode("nid\x1b8", now, now, "r", "41", "hang", "x").line(),
               "nid9": BadNode("nid9", now, "2099-01-01T00:00:00+00:00", "r", "41", "hang", "x").line(),
               "nid10\n": "slipway-bad-node node=nid10"}
    for name, text in hostile.items():
        (memory / name).write_text(text + "\n")
    shell = {**shell, "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    r = slipway(shell, "nodes", "--cluster", "alps")
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and "remembers no bad node" in lines[0] and len(lines) == 1 + len(hostile), r.stdout
    assert "nid9: dated 2099-01-01T00:00:00+00:00, ahead of this host's clock" in r.stdout
    for line in lines[1:]:
        assert line.isprintable(), line
        forgot = pasted(hint(line, "nodes"), shell)
        assert forgot.returncode == 0 and forgot.stdout.startswith("forgot "), (line, forgot.stdout, forgot.stderr)
    assert not any(memory.iterdir()), sorted(memory.iterdir())


# ---------------------------------------------------------------- doctor and the local cluster


@pytest.mark.slow
@covers("jobs/cli/doctor.py: slipway cluster up", "jobs/cli/doctor.py: slipway cluster up",
        "jobs/cli/doctor.py: slipway cluster status", "jobs/devcluster/command.py: slipway cluster up{named}",
        "jobs/devcluster/command.py: slipway cluster up{named}")
def test_the_local_clusters_commands(project, shell, tmp_path):
    from jobs.devcluster import ClusterSpec, render_slurm_conf

    bare = without_slurm_daemons(tmp_path, shell)
    # No Slurm on PATH: doctor names the local cluster.
    r = slipway(shell, "doctor", extra=bare)
    up = pasted(hint(r.stdout, "cluster up"), shell, bare)
    assert up.returncode == 1 and "missing munged, slurmctld, slurmd" in up.stderr, (up.stdout, up.stderr)
    # SLURM_CONF left from a local cluster that is down.
    conf = tmp_path / "slurm.conf"
    conf.write_text(render_slurm_conf(ClusterSpec(state_dir=Path("/tmp/slipway-gone"), nodes=2)))
    if shutil.which("scontrol"):
        r = slipway(shell, "submit", "tiny_cpu", extra={"SLURM_CONF": str(conf)})
        assert r.returncode == 1
        up = pasted(hint(r.stderr, "cluster up"), shell, bare)
        assert up.returncode == 1 and "missing munged" in up.stderr, up.stderr
        # SLURM_CONF naming no file: no controller answers.
        r = slipway(shell, "submit", "tiny_cpu", extra={"SLURM_CONF": str(tmp_path / "none.conf")})
        status = pasted(hint(r.stderr, "cluster status"), shell)  # the machine's test cluster, up or not
        said = status.stdout.splitlines()  # for a person: up or not first, then its nodes and processes
        assert said[0].startswith("cluster slpw: up, state in ") if status.returncode == 0 else (
            len(said) == 1 and re.fullmatch(r"cluster slpw: not up; `\S*slipway cluster up` starts it", said[0])), said
        if status.returncode:  # the command it names, pasted: gets as far as naming what this machine lacks
            up = pasted(hint(status.stdout, "cluster up"), shell, bare)
            assert up.returncode == 1 and "missing munged" in up.stderr, up.stderr
        machine = pasted(f"{hint(r.stderr, 'cluster status')} --json", shell)
        assert json.loads(machine.stdout)["name"] == "slpw" and machine.returncode == status.returncode
    # A cluster of another name that is not up: the command that starts that one.
    r = slipway(shell, "cluster", "env", "--name", "fhx")
    command = hint(r.stderr, "cluster up")
    assert command.endswith("--name fhx"), command
    up = pasted(command, shell, bare)
    assert up.returncode == 1 and "missing munged" in up.stderr, up.stderr


@pytest.mark.slow
@covers("jobs/cli/doctor.py: slipway submit {shlex.quote(str(run.paths.config))}",
        "jobs/cli/doctor.py: slipway submit {shlex.quote(str(run.paths.config))}")
def test_resubmit_a_run_whose_pins_are_gone(project, shell, tmp_path, pin_config):  # noqa: F811
    env = slurm(tmp_path, shell)
    pinned = fake_build(project, source="1")
    assert slipway(shell, "submit", "pin", *PYXIS, "--run-name", "kept", extra=env).returncode == 0
    # The image it pinned is gone; the config builds another now.
    pinned.unlink()
    fake_build(project, source="2")
    r = slipway(shell, "doctor", "--run", "kept", extra=env)
    line = next(x for x in r.stdout.splitlines() if x.startswith("fail pinned image"))
    again = pasted(hint(line, "submit"), shell, env)
    assert again.returncode == 0 and "resubmitted kept" in again.stdout, (again.stdout, again.stderr)
    # Its code snapshot damaged: a submission writes it anew.
    manifest = json.loads((project / "runs" / "kept" / "manifest.json").read_text())
    code = Path(manifest["code"]["dir"])
    next(p for p in code.rglob("*.py")).write_text("# damaged\n")
    r = slipway(shell, "doctor", "--run", "kept", extra=env)
    line = next(x for x in r.stdout.splitlines() if x.startswith("fail pinned code"))
    again = pasted(hint(line, "submit"), shell, env)
    assert again.returncode == 0 and "resubmitted kept" in again.stdout, (again.stdout, again.stderr)
    assert "ok   pinned code" in slipway(shell, "doctor", "--run", "kept", extra=env).stdout


# ---------------------------------------------------------------- the image


@pytest.mark.slow
@covers("containers/diagnose.py: slipway doctor", "containers/importer.py: slipway image prune",
        "trainer/compute.py: slipway image build CONFIG", "trainer/preflight.py: slipway image build CONFIG")
def test_the_image_commands(project, shell, tmp_path, pin_config):  # noqa: F811
    from common.environ import as_typed

    tools = {"PATH": f"{write_standins(tmp_path / 'image-bin', 'podman', 'enroot', 'srun')}{os.pathsep}"
                     f"{shell['PATH']}"}
    # podman's storage full: doctor shows where it is.
    r = slipway(shell, "image", "build", "pin", extra={**tools, "FAKE_PODMAN_FAIL": "disk"})
    assert r.returncode != 0 and "no space left" in r.stdout + r.stderr, (r.stdout, r.stderr)
    doctor = pasted(hint(r.stdout + r.stderr, "doctor"), shell, tools)
    assert doctor.returncode in (0, 1) and "podman" in doctor.stdout and "usage" not in doctor.stderr, doctor.stderr
    # enroot's leftover container that podman would not remove: prune retries.
    r = slipway(shell, "image", "build", "pin", extra={**tools, "FAKE_PODMAN_RM_FAIL": ".*"})
    assert r.returncode == 0, r.stderr
    prune = pasted(hint(r.stdout, "image prune"), shell, tools)
    assert prune.returncode == 0 and "removed podman container enroot." in prune.stdout, prune.stdout
    # The trainer's own: numactl missing on a node that binds NUMA nodes (the preflight, in a job's
    # log; `slipway logs` and `slipway run` give its CONFIG), torchao missing for float8.
    bare = without_slurm_daemons(tmp_path, shell, "numactl")["PATH"]
    for code in ("from trainer.preflight import check_numactl; print(check_numactl()[1])",
                 "import sys; sys.modules['torchao'] = None\nfrom trainer.compute import require_torchao\n"
                 "try:\n    require_torchao()\nexcept Exception as exc:\n    print(exc)"):
        said = subprocess.run([PY, "-c", code], capture_output=True, text=True, env={**os.environ, "PATH": bare},
                              cwd=ROOT).stdout
        with_config = as_typed(said, "pin")  # as slipway shows the trainer's lines: this run's config
        built = pasted(hint(with_config.replace("`slipway", "`.venv/bin/slipway"), "image build"), shell, tools)
        assert built.returncode == 0 and "image " in built.stdout and ".sqsh" in built.stdout, built.stderr


# ---------------------------------------------------------------- a local run, end to end


@pytest.mark.slow
@pytest.mark.multiproc
@covers("jobs/interactive.py: {prog} status {name}", "jobs/interactive.py: {prog} watch {name}",
        "jobs/interactive.py: {prog} submit {cluster} --dry-run",
        "trainer/data.py: slipway prepare CONFIG")
def test_what_next_after_a_local_run(project, shell):
    r = slipway(shell, "local", "tiny_cpu", *SMALL, "train.steps=3", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:]
    # The trainer's note while rank 0 tokenizes, with this run's config.
    prepare = pasted(hint(r.stdout, "prepare"), shell)
    assert prepare.returncode == 0 and "prepared" in prepare.stdout, prepare.stderr
    nxt = next(line for line in r.stdout.splitlines() if line.startswith("next: "))
    status = pasted(hint(nxt, "status"), shell)
    assert status.returncode == 0 and "tiny_cpu" in status.stdout and "COMPLETED" in status.stdout, status.stdout
    watch = pasted(hint(nxt, "watch"), shell)
    assert watch.returncode == 0 and "job local ended: COMPLETED, exit code 0" in watch.stdout, watch.stdout
    dry = pasted(hint(nxt, "submit"), shell)  # a run of its own: nothing of this one's refuses it
    assert dry.returncode == 0 and dry.stdout.startswith("dry run: tiny_cpu-cluster (new run)"), dry.stdout


@pytest.mark.slow
@pytest.mark.multiproc
@covers("jobs/interactive.py: {environ.invocation()} {'run' if allocation else 'local'} {cfg.config_args}{confirmed}")
def test_resume_an_interrupted_local_run(project, shell):
    run_dir = project / "runs" / "cc"
    launcher = subprocess.Popen([*SLIPWAY, "local", "tiny_cpu", "--run-name", "cc", *SMALL, "train.steps=40"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=shell,
                                start_new_session=True, preexec_fn=default_signals)
    try:
        deadline = time.monotonic() + 300
        while not ((run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text().count("\n") >= 2):
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.2)
        os.killpg(launcher.pid, signal.SIGINT)
        out = launcher.communicate(timeout=120)[0]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    resumed = pasted(hint(out.splitlines()[-1], "local"), shell, timeout=600)
    assert resumed.returncode == 0 and "resuming run cc" in resumed.stdout, resumed.stdout[-3000:]


@pytest.mark.slow
@covers("jobs/local_checks.py: slipway local {self.fix}")
def test_a_try_that_fits_this_machines_time(project, shell):
    r = slipway(shell, "local", "tiny_cpu", *SMALL, "train.steps=100000000")
    assert r.returncode == 2 and "more than a try on this machine (30m00s)" in r.stderr, r.stderr
    command = hint(r.stderr, "local")
    assert "--train-steps" in command and "--yes" not in command, command
    # Pasted, it passes every check and starts; stopped once it has (Ctrl-C: its processes end).
    launcher = subprocess.Popen(["bash", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=shell, start_new_session=True, preexec_fn=default_signals)
    try:
        first = "".join(launcher.stdout.readline() for _ in range(3))
        assert "\nexpected here: ~" in first and "new run tiny_cpu" in first, first
        os.killpg(launcher.pid, signal.SIGINT)
        launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


@pytest.mark.slow
@covers("jobs/local_checks.py: slipway local {cfg.config_args_setting(settings)}")
def test_a_sweep_point_that_fits_this_machines_memory(project, shell):
    r = slipway(shell, "sweep", "tiny_cpu", "train.micro_batch_size=[8, 4096]", "--local", "--dry-run")
    assert r.returncode == 2 and "GB free: `" in r.stderr and "keeps the layout and the global batch" in r.stderr
    dry = pasted(f"{hint(r.stderr, 'local')} --dry-run", shell)  # its memory fits (its time is another matter)
    assert dry.returncode in (0, 2) and "verdict: would be" in dry.stdout, (dry.stdout, dry.stderr)
    assert "train.micro_batch_size:" not in dry.stdout, dry.stdout


# ---------------------------------------------------------------- the trainer's data hints


@pytest.mark.slow  # the trainer itself, once (torch's import and a process group)
@covers("trainer/data.py: slipway prepare CONFIG", "trainer/data.py: slipway submit CONFIG --prepare",
        "trainer/data_sources.py: slipway prepare CONFIG", "trainer/data_tokenize.py: slipway prepare CONFIG")
def test_the_trainers_data_hints_name_the_config(project, shell, tmp_path, hub_without_it):
    # A job's log: the trainer found the cache unprepared (it went after submission); `slipway logs`
    # shows the hint with the run's config.
    corpus(project)
    env = slurm(tmp_path, shell)
    given = ["tiny_cpu", "--dataset", "./corpus", "--text-column", "body", "data.validation_fraction=0", "--dp", "1",
             "--procs-per-node", "1"]  # one process: the trainer run here by hand
    assert slipway(shell, "submit", *given, "--prepare", extra=env).returncode == 0
    trainer = subprocess.run([PY, "-m", "trainer", "--config", "runs/tiny_cpu/config.yaml"], capture_output=True,
                             text=True, timeout=300, env={**os.environ, "SLIPWAY_RUN_DIR": str(project / "runs" /
                                                                                                  "tiny_cpu")})
    assert trainer.returncode != 0 and "`slipway prepare CONFIG`" in trainer.stderr, trainer.stderr
    (project / "runs" / "tiny_cpu" / "logs" / "4243.out").write_text(trainer.stderr)  # after the preparation job
    log = slipway(shell, "logs", "tiny_cpu", extra=env).stdout
    prepare = pasted(hint(log, "prepare"), shell, env)
    assert prepare.returncode == 0 and "200 documents" in prepare.stdout, (prepare.stdout, prepare.stderr)
    submit = pasted(hint(log, "submit"), shell, env)
    assert submit.returncode == 0 and "resubmitted" in submit.stdout, (submit.stdout, submit.stderr)
    # The hub out of reach or without the dataset or tokenizer, in `slipway prepare` here.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    for endpoint, args, said in ((closed, ["--dataset", "wikitxt", "--text-column", "text"], "cannot be reached"),
                                 (closed, ["--tokenizer", "gpt3-nope"], "cannot be reached"),
                                 (hub_without_it, ["--dataset", "wikitxt", "--text-column", "text"], "doesn't exist")):
        hub = {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf")}
        r = slipway(shell, "prepare", "tiny_cpu", "--run-name", "hub", *args, extra=hub)
        assert r.returncode == 2 and said in r.stderr, r.stderr
        command = hint(r.stderr, "prepare")
        assert shlex.split(command)[1:] == ["prepare", "tiny_cpu", "--run-name", "hub", *args], command
        again = pasted(command, shell, hub)  # where the hub is still out of reach: the same one line
        assert again.returncode == 2 and again.stderr.split("`")[0] == r.stderr.split("`")[0], again.stderr
        assert shlex.split(hint(again.stderr, "prepare"))[1:] == shlex.split(command)[1:]
