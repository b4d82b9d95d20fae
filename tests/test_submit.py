"""Submission on a real Slurm (Debian slurm-wlm started by the tests): run directory,
status, logs, cancel, --show-logs exit codes, resubmission, and bad input."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tree

PY = sys.executable


def slipway(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "jobs", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def task(code: str) -> list[str]:
    """Overrides that make each rank run a small Python program instead of the trainer."""
    return ["launch.launcher=srun", f"launch.command=[{PY}, -c, {json.dumps(code)}]"]


WRITE_RANK = ("import os, socket, pathlib; d = pathlib.Path(os.environ['SLIPWAY_RUN_DIR']); "
              "(d / f\"rank{os.environ['RANK']}\").write_text(socket.gethostname() + ' ' + "
              "os.environ['WORLD_SIZE'] + ' ' + os.environ['LOCAL_RANK']); print('hello from', os.environ['RANK'])")


# ------------------------------------------------------------------ no Slurm needed


def test_dry_run_writes_nothing(project):
    before = tree(project)
    r = slipway("submit", "tiny_cpu", "--dry-run", "--run-name", "dry")
    assert r.returncode == 0, r.stderr
    assert "#SBATCH --job-name=dry" in r.stdout and "nothing written" in r.stdout
    assert tree(project) == before


@pytest.mark.parametrize("args, field", [
    (["--run-name", "x$(touch pwned)"], "run.name"),
    (["--dp", "3"], "parallel"),
    (["train.nope=1"], "train.nope"),
    (["--runtime", "edf", "--image", "/nonexistent/x.sqsh"], "container.image"),
    (["--runtime", "edf", "--image", "rel/x.sqsh"], "container.image"),
    (["container.runtime=pyxis", "container.image=nvcr.io#nvidia/pytorch:25.01-py3",
      "container.mounts=[/nonexistent-src:/d]"],
     "container.mounts[0]"),
    (["--tp", "3", "--dp", "1", "launch.procs_per_node=3"], "parallel.tp"),
])
def test_bad_input_one_line_exit_2_nothing_written(project, args, field):
    before = tree(project)
    r = slipway("submit", "tiny_cpu", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"slipway: error: {field}"), r.stderr
    assert tree(project) == before
    assert not list(project.parent.rglob("pwned"))


# ------------------------------------------------------------------ a real Slurm


@pytest.mark.slurm
def test_submit_runs_and_shows_logs(project, slurm_env):
    r = slipway("submit", "tiny_cpu", "--run-name", "hello", "--nodes", "2", *task(WRITE_RANK), "--show-logs")
    assert r.returncode == 0, (r.stdout, r.stderr)
    run_dir = project / "runs" / "hello"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    job_id = manifest["submissions"][0]["job_id"]
    assert job_id in r.stdout and "hello from 3" in r.stdout
    ranks = {p.name: p.read_text().split() for p in run_dir.glob("rank*")}
    assert sorted(ranks) == ["rank0", "rank1", "rank2", "rank3"]
    assert {v[0] for v in ranks.values()} == {"node1", "node2"} and {v[1] for v in ranks.values()} == {"4"}
    for name in ("config.yaml", "job.sbatch", "manifest.json", "events.log", "heartbeat", f"logs/{job_id}.out"):
        assert (run_dir / name).exists(), name
    assert manifest["git"].keys() == {"commit", "dirty"} and manifest["runtime"] == "none"
    assert f"job {job_id} end exit 0" in (run_dir / "events.log").read_text()
    assert not list(project.parent.rglob("pwned"))

    logs = slipway("logs", "hello")
    assert logs.returncode == 0 and "hello from 0" in logs.stdout
    status = slipway("status", "hello")
    assert status.returncode == 0 and job_id in status.stdout and "COMPLETED" in status.stdout

    # The same run name and config again: a resumption, a second job id in the manifest.
    again = slipway("submit", "tiny_cpu", "--run-name", "hello", "--nodes", "2", *task(WRITE_RANK), "--show-logs")
    assert again.returncode == 0, again.stderr
    jobs = [s["job_id"] for s in json.loads((run_dir / "manifest.json").read_text())["submissions"]]
    assert len(jobs) == 2 and jobs[0] == job_id and "resubmitted" in again.stdout
    # A different config under the same name is refused, then accepted with --force (old config kept).
    other = slipway("submit", "tiny_cpu", "--run-name", "hello", "--nodes", "2", *task(WRITE_RANK), "--seed", "7")
    assert other.returncode == 2 and "--force" in other.stderr
    forced = slipway("submit", "tiny_cpu", "--run-name", "hello", "--nodes", "2", *task(WRITE_RANK), "--seed", "7",
                     "--force", "--show-logs")
    assert forced.returncode == 0, forced.stderr
    assert len(list((run_dir / "history").glob("config-*.yaml"))) == 1


@pytest.mark.slurm
def test_a_secret_passed_by_name_reaches_every_rank_and_no_file(project, slurm_env):
    """docs/secrets.md on the real Slurm: sbatch takes the variable into the job, every rank has
    it, and neither the run directory (its logs hold the batch script's set -x trace) nor what
    slipway prints holds its value."""
    secret = "hf_" + os.urandom(16).hex()
    code = "import os; print('rank', os.environ['RANK'], 'token', len(os.environ.get('HF_TOKEN', '')))"
    r = slipway("submit", "tiny_cpu", "--run-name", "sec", "--nodes", "2", *task(code), "launch.debug=true",
                "container.env_from_host=[HF_TOKEN]", "--show-logs", env={"HF_TOKEN": secret})
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert all(f"rank {i} token {len(secret)}" in r.stdout for i in range(4)), r.stdout
    assert secret not in r.stdout + r.stderr
    leaked = [p for p in (project / "runs").rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not leaked, leaked
    assert "+ " in "".join(p.read_text() for p in (project / "runs" / "sec" / "logs").iterdir())  # traced


@pytest.mark.slurm
def test_show_logs_exit_code_is_the_jobs(project, slurm_env):
    r = slipway("submit", "tiny_cpu", "--run-name", "fails", *task("import sys; print('bye'); sys.exit(3)"),
                "--show-logs")
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "bye" in r.stdout
    status = slipway("status")
    assert status.returncode == 0 and "fails" in status.stdout and "FAILED" in status.stdout


@pytest.mark.slurm
def test_show_logs_says_why_a_job_waits(project, slurm_env):
    """A job that cannot start yet is followed with Slurm's reason (a node down, a hold, a start
    time), not a bare PENDING that reads as a hang."""
    r = slipway("submit", "tiny_cpu", "--run-name", "later", *task("print('ran at last')"),
                "slurm.extra=[--begin=now+4]", "--show-logs")
    assert r.returncode == 0 and "ran at last" in r.stdout, (r.stdout, r.stderr)
    job = json.loads((project / "runs" / "later" / "manifest.json").read_text())["submissions"][0]["job_id"]
    assert f"job {job}: PENDING (BeginTime)" in r.stdout, r.stdout


def sleeper(project: Path, name: str) -> str:
    """A job of run `name` that trains nothing and sleeps, once its output says it is up: its id."""
    r = slipway("submit", "tiny_cpu", "--parsable", "--run-name", name,
                *task("import time; print('up', flush=True); time.sleep(600)"))
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().splitlines()[-1]
    log = project / "runs" / name / "logs" / f"{job_id}.out"
    deadline = time.time() + 60
    while time.time() < deadline and "up" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.5)
    return job_id


def status_row(run: str, job_id: str) -> list[str]:
    """(job, state, exit, ...) of job `job_id` in `slipway status RUN`'s table."""
    out = slipway("status", run, env={"COLUMNS": "300"}).stdout
    rows = [cells for line in out.splitlines() if (cells := [c.strip() for c in line.split("│")[1:-1]])]
    return next(cells for cells in rows if cells[0] == job_id)


@pytest.mark.slurm
def test_cancel(project, slurm_env):
    job_id = sleeper(project, "sleeper")
    assert "RUNNING" in slipway("status", "sleeper").stdout
    c = slipway("cancel", "sleeper")
    assert c.returncode == 0 and job_id in c.stdout
    assert status_row("sleeper", job_id)[1:3] == ["CANCELLED", "140"]
    assert f"job {job_id} end exit 140" in (project / "runs" / "sleeper" / "events.log").read_text()
    assert "no active job" in slipway("cancel", "sleeper").stdout


@pytest.mark.slurm
def test_a_plain_scancel_is_one_exit_code_in_events_status_and_logs(project, slurm_env):
    """The batch script records 143; Slurm, which SIGKILLs its cleanup after KillWait, says 0:9."""
    job_id = sleeper(project, "scancelled")
    subprocess.run(["scancel", job_id], check=True)
    deadline = time.time() + 90
    while time.time() < deadline and subprocess.run(["squeue", "-h", "-t", "all", f"-j{job_id}", "-o", "%T"],
                                                    capture_output=True, text=True).stdout.strip() not in (
            "CANCELLED", ""):
        time.sleep(0.5)
    assert f"job {job_id} end exit 143" in (project / "runs" / "scancelled" / "events.log").read_text()
    assert status_row("scancelled", job_id)[1:3] == ["CANCELLED", "143"]
    assert slipway("logs", "scancelled", "-f").returncode == 143


@pytest.mark.slurm
def test_sbatch_rejection_leaves_no_run(project, slurm_env):
    before = tree(project)
    r = slipway("submit", "tiny_cpu", "--run-name", "nopart", "--partition", "nosuchpartition")
    assert r.returncode == 1 and "sbatch failed" in r.stderr
    assert tree(project) == before


def test_shell_command_line(project, tmp_path):
    img = project / "img.sqsh"
    img.write_bytes(b"hsqs")
    r = slipway("shell", "tiny_cpu", "container.runtime=edf", f"container.image={img}", "--run-name", "sh",
                "--account", "a-01", "--dry-run")
    assert r.returncode == 0, r.stderr
    *edf_lines, command = r.stdout.splitlines()  # the EDF a shell would write (privately, while it runs)
    words = shlex.split(command)
    env_toml = Path(words[-2].split("=", 1)[1])
    assert words == ["srun", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=00:30:00",
                     "--account=a-01", "--pty", f"--environment={env_toml}", "bash"]
    assert env_toml.parent.parent == project / "runs" / ".shell" and not (project / "runs").exists()
    from edf import parse_edf

    assert parse_edf("\n".join(edf_lines[1:])).image == str(img)
    r = slipway("shell", "tiny_cpu", "container.runtime=pyxis", "container.image=nvcr.io/nvidia/pytorch:25.12-py3",
                "--dry-run")
    assert "--container-image=nvcr.io#nvidia/pytorch:25.12-py3" in r.stdout and "--pty" in r.stdout


@pytest.mark.slurm
def test_shell_runs_in_the_allocation(project, slurm_env):
    r = slipway("shell", "tiny_cpu", "--command", "bash", "-c", "echo on $(hostname) as $SLURM_JOB_ID")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("on node1 as ")


@pytest.mark.slurm
def test_doctor(project, slurm_env):
    r = slipway("doctor", "tiny_cpu")
    assert "ok   sbatch" in r.stdout and "ok   parallel layout" in r.stdout
    r = slipway("doctor", "tiny_cpu", "container.runtime=edf", "container.image=./images/missing.sqsh")
    assert r.returncode == 1
    assert "fail image: container.image: squashfs ./images/missing.sqsh" in r.stdout
    assert "ok   slurm controller" in slipway("doctor").stdout


def test_plot(project):
    run = project / "runs" / "p1"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text("{}")
    assert slipway("plot", "p1").returncode == 2  # no metrics yet: one line, exit 2
    lines = [{"kind": "train", "step": s, "loss": 5 - s / 10, "tokens_per_s": 1000.0, "mfu": None} for s in (1, 2, 3)]
    lines.append({"kind": "eval", "step": 3, "eval_loss": 4.5})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    r = slipway("plot", "p1")
    assert r.returncode == 0, r.stderr
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = project / "figures" / "p1.png"  # --out: a folder made for it, its path said, nothing beside it
    r = slipway("plot", "p1", "--out", str(out))
    assert r.returncode == 0 and r.stdout == f"{out}\n" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", r.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == ["p1.png"]
    r = slipway("plot", "p1", "--out", str(out.parent))  # a folder given: named, not our temporary file
    assert r.returncode == 2 and r.stderr == f"slipway: error: {out.parent}: Is a directory: check the path and its " \
                                             "permissions\n", r.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == ["p1.png"]


def test_write_atomic_keeps_an_os_error_that_names_no_errno(tmp_path, monkeypatch):
    """An OSError with an errno is said of the caller's path (above); one without (a file object's
    UnsupportedOperation) is no path problem and stays what it was. Either way nothing is left."""
    import io

    from common import fs

    error = io.UnsupportedOperation("fsync is not supported here")

    def fsync(fd):
        raise error

    monkeypatch.setattr(fs.os, "fsync", fsync)
    with pytest.raises(io.UnsupportedOperation) as raised:
        fs.write_atomic(tmp_path / "f.json", "{}")
    assert raised.value is error and list(tmp_path.iterdir()) == []


def test_image_subcommand_reaches_the_image_tool(project):
    r = slipway("image", "--help")
    assert r.returncode == 0 and "build" in r.stdout and "prune" in r.stdout


# ------------------------------------------------------------------ data preparation (no Slurm)


def test_prepare_with_the_seed_launchers_data_flags(project):
    corpus = project / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(json.dumps({"body": f"document {i} " * 40}) + "\n" for i in range(200)))
    flags = ["--dataset", "./corpus", "--text-column", "body", "--tokenizer", "builtin"]
    refused = slipway("submit", "tiny_cpu", "--dry-run", *flags)
    assert "\n  - data: the token cache is not prepared" in refused.stdout
    r = slipway("prepare", "tiny_cpu", *flags, "--cpus", "2")
    assert r.returncode == 0, r.stderr
    assert "200 documents" in r.stdout and "prepared:" in r.stdout
    bins = list((project / ".cache" / "tokens").glob("corpus-*.bin"))
    assert len(bins) == 1 and bins[0].stat().st_size > 0
    assert "  - data: " not in slipway("submit", "tiny_cpu", "--dry-run", *flags).stdout
    again = slipway("prepare", "tiny_cpu", *flags)  # prepared once for every run
    assert again.returncode == 0 and list((project / ".cache" / "tokens").glob("corpus-*.bin")) == bins


@pytest.mark.slow
def test_prepare_of_an_unreachable_dataset_is_one_line(project):
    before = tree(project)
    r = slipway("prepare", "tiny_cpu", "--dataset", "no-such-org/no-such-set", "--dataset-config", "x",
                env={"HF_HUB_OFFLINE": "1"}, timeout=300)
    assert r.returncode == 2, (r.stdout, r.stderr)
    errors = [line for line in r.stderr.splitlines() if line.startswith("slipway: error:")]
    assert len(errors) == 1 and errors[0].startswith("slipway: error: data.dataset:") and "Traceback" not in r.stderr
    assert not list((project / "runs").glob("*")) if (project / "runs").exists() else True
    assert [p for p in tree(project) if p.startswith("runs")] == [p for p in before if p.startswith("runs")]


def test_prepare_job_script(project):
    from jobs import runs
    from jobs.config import load_config

    img = project / "img.sqsh"
    img.write_bytes(b"hsqs")
    cfg = load_config("tiny_cpu", ["container.runtime=pyxis", f"container.image={img}", "slurm.prepare_cpus=16",
                                   "slurm.prepare_partition=cpu", "slurm.account=a-01", "run.name=p1"])
    sealed = runs.seal(cfg, project).with_prepare_script()
    text = sealed.files[sealed.paths.prepare_script]
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    header = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert header[:5] == ["#SBATCH --job-name=p1-prepare", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1",
                          "#SBATCH --cpus-per-task=16", "#SBATCH --time=02:00:00"]
    assert "#SBATCH --partition=cpu" in header and "#SBATCH --no-requeue" in header
    assert not any("gpu" in line for line in header)
    line = next(x for x in text.splitlines() if re.search(r"(^| )srun --", x))
    srun = shlex.split(text[text.index(line):].replace("\\\n", " "))
    assert srun[:1] == ["SLIPWAY_CODE=" + sealed.code.value.dir]  # the prepare job runs the run's code too
    train = shlex.split(sealed.files[sealed.paths.job_script].split("srun --kill-on-bad-exit=1", 1)[1].split("\n")[0].rstrip("\\"))
    # the same container as the training job's srun line; only the training job's steps share
    # a named container (its preflight unpacks it), the prepare job's single step has no one to share with
    assert [a for a in srun if a.startswith("--container")] == [
        a for a in train if a.startswith("--container") and not a.startswith("--container-name=")]
    assert "--container-name=${CONTAINER_NAME}:no_exec" in train and not any(a.startswith("--container-name") for a in srun)
    assert srun[-7:] == ["python3", "-m", "trainer.prepare", "--config", str(project / "runs" / "p1" / "config.yaml"),
                         "--cpus", "16"]
