"""The dev loop: each launch runs a snapshot of the code it was launched with (jobs/runs/code.py).

The store's own rules (content addressed, read-only, bounded, recorded) run in
seconds; on the local Slurm a submission, an edit of the checkout and a second
submission show that a job runs the code it was submitted with, through a
requeue, and that identical code is stored once.
"""

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

from jobs.runs.code import LISTING, PRUNE_AFTER_SECONDS, STORE, plan_snapshot
from conftest import default_signals
from common.errors import ConfigError
from common.rundir import CODE_ENV, CodeSnapshot, check_code
from common.schema import from_dict

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def checkout(project: Path) -> Path:
    """The project as a checkout of its own: slipway, run from it, snapshots its common/ and trainer/."""
    for name in ("common", "trainer"):
        shutil.copytree(ROOT / name, project / name, ignore=shutil.ignore_patterns("__pycache__"))
    return project / "trainer"


def mark(project: Path, word: str) -> None:
    """Make the checkout's trainer append WORD to RUN/code-marks when rank 0 starts."""
    text = (ROOT / "trainer" / "train.py").read_text()
    anchor = "    args = parser.parse_args(argv)\n"
    line = ("    if os.environ.get('RANK', '0') == '0':\n"
            f"        open(os.path.join(os.environ['SLIPWAY_RUN_DIR'], 'code-marks'), 'a').write('{word}\\n')\n")
    assert anchor in text
    (project / "trainer" / "train.py").write_text(text.replace(anchor, anchor + line, 1))


def slipway(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    # cwd is the project (the fixture's chdir): `python -m jobs` imports the project's trainer first.
    return subprocess.run([PY, "-m", "jobs", *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ))


# ------------------------------------------------------------------ the store, in seconds


def test_a_snapshot_is_content_addressed_read_only_and_written_once(project, monkeypatch):
    source = checkout(project)
    monkeypatch.setattr("jobs.runs.code.trainer_source", lambda project_dir=None: source)
    store = project / "runs" / STORE
    first = plan_snapshot(store, None)
    assert not store.exists()  # planning writes nothing (a dry run)
    value = first.write()
    snap = Path(value.dir)
    assert snap.parent == store and snap.name == value.hash[:16] and (snap / "trainer" / "train.py").is_file()
    assert not list(snap.rglob("__pycache__")) and value.files == len([p for p in snap.rglob("*") if p.is_file() and p.name != LISTING])
    assert not os.access(snap / "trainer" / "train.py", os.W_OK) or os.geteuid() == 0
    assert (snap / "trainer" / "train.py").stat().st_mode & 0o222 == 0
    # The same content again: the same directory, not rewritten.
    before = (snap / "trainer" / "train.py").stat().st_mtime_ns
    again = plan_snapshot(store, None).write()
    assert again == value and (snap / "trainer" / "train.py").stat().st_mtime_ns == before
    # One byte changed: another snapshot; the first is untouched.
    (source / "model.py").write_text((source / "model.py").read_text() + "\n# changed\n")
    changed = plan_snapshot(store, None).write()
    assert changed.hash != value.hash and snapshots(store) == sorted([value.dir[-16:], changed.dir[-16:]])
    assert "# changed" not in (snap / "trainer" / "model.py").read_text()
    # The manifest's record reads back as the same value.
    assert from_dict(CodeSnapshot, json.loads(json.dumps(changed.record())), record=True) == changed


def snapshots(store: Path) -> list[str]:
    return sorted(p.name for p in store.iterdir() if not p.name.startswith("."))


def test_the_store_keeps_what_runs_name_and_what_launches_used_lately(project, monkeypatch):
    """prune_store: a snapshot no run names goes once no launch has written or reused it for the
    grace; named ones and recent ones stay; a write or a pruning cut short is cleared; nothing
    goes while another launch holds the store."""
    from jobs.runs.code import store_lock, prune_store

    source = checkout(project)
    monkeypatch.setattr("jobs.runs.code.trainer_source", lambda project_dir=None: source)
    store = project / "runs" / STORE
    named = plan_snapshot(store, None).write()
    (source / "model.py").write_text((source / "model.py").read_text() + "\n# one\n")
    orphan = plan_snapshot(store, None).write()
    (source / "model.py").write_text((source / "model.py").read_text() + "\n# two\n")
    recent = plan_snapshot(store, None).write()
    (store / ".deadbeef.x1.tmp").mkdir()  # a write cut short
    (store / ".removing-0123456789abcdef" / "trainer").mkdir(parents=True)  # a pruning cut short
    old = time.time() - PRUNE_AFTER_SECONDS - 60
    for snap in (named, orphan):
        os.utime(snap.dir, (old, old))
    keep = {Path(named.dir).name}
    with store_lock(store, exclusive=False):  # a launch writing or reusing a snapshot meanwhile
        assert prune_store(store, keep) == []
    removed = prune_store(store, keep)
    assert [name for name, _ in removed] == [Path(orphan.dir).name] and removed[0][1] == orphan.bytes
    assert snapshots(store) == sorted([Path(named.dir).name, Path(recent.dir).name])
    assert not [p for p in store.iterdir() if p.name.startswith(".") and p.name != ".lock"]
    # A reuse restarts the grace: a snapshot a launch reuses now stays while no run names it yet.
    os.utime(recent.dir, (old, old))
    plan_snapshot(store, None).write()  # the checkout still holds `recent`'s content
    assert prune_store(store, keep) == [] and Path(recent.dir).is_dir()


def test_the_snapshot_is_of_the_checkout_the_launch_runs_from(project, tmp_path):
    """A login node's non-editable install still snapshots the checkout the user edits."""
    from jobs.runs.code import trainer_source

    assert trainer_source(tmp_path) == (ROOT / "trainer").resolve()  # no checkout there: the imported one
    source = checkout(project)
    assert trainer_source(project) == source.resolve()
    value = plan_snapshot(project / "runs" / STORE, None, project).value
    assert value.source == str(source.resolve())


def test_a_train_script_is_snapshotted_with_its_folder_and_bounded(project, monkeypatch):
    folder = project / "scripts"
    folder.mkdir()
    (folder / "train_mine.py").write_text("import helper\n")
    (folder / "helper.py").write_text("X = 1\n")
    value = plan_snapshot(project / "runs" / STORE, str(folder / "train_mine.py")).write()
    assert value.script == f"{value.dir}/script/train_mine.py"
    assert (Path(value.dir) / "script" / "helper.py").read_text() == "X = 1\n"
    monkeypatch.setattr("jobs.runs.code.MAX_FILES", value.files + 2)
    for i in range(3):
        (folder / f"data{i}.txt").write_text("x" * (1000 + i))
    with pytest.raises(ConfigError, match=r"^train.script: the code to copy holds .* largest: .*code.snapshot: false"):
        plan_snapshot(project / "runs" / STORE, str(folder / "train_mine.py"))


@pytest.mark.slow
def test_the_trainer_refuses_to_run_other_code_than_the_snapshot(tmp_path):
    snap = tmp_path / "snap"
    (snap / "trainer").mkdir(parents=True)
    assert check_code(str(snap / "trainer" / "train.py"), {CODE_ENV: str(snap)}) is None
    assert check_code(str(ROOT / "trainer" / "train.py"), {}) is None  # no snapshot named: any code
    why = check_code(str(ROOT / "trainer" / "train.py"), {CODE_ENV: str(snap)})
    assert why and str(snap) in why and "code.snapshot: false" in why
    # Through the real entry point: exit 2 and one line, before anything is read.
    r = subprocess.run([PY, "-m", "trainer", "--config", "nowhere.yaml"], capture_output=True, text=True,
                       env={**os.environ, CODE_ENV: str(snap)}, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not the run's code snapshot" in r.stderr


@pytest.mark.slow
def test_every_runtime_runs_the_snapshot(project):
    """The dry run's files: env.toml (edf), the srun line (pyxis) and the job's exports (none)
    all put the snapshot first; code.snapshot: false leaves the image's code."""
    checkout(project)
    img = project / "img.sqsh"
    img.write_bytes(b"hsqs")
    out = {}
    for runtime in ("edf", "pyxis", "none"):
        extra = [f"container.image={img}"] if runtime != "none" else []
        r = slipway("submit", "tiny_cpu", "--dry-run", f"container.runtime={runtime}", *extra)
        assert r.returncode == 0, r.stderr
        out[runtime] = r.stdout
    line = next(line for line in out["none"].splitlines() if line.startswith("export SLIPWAY_CODE="))
    code = shlex.split(line)[1].split("=", 1)[1]
    assert code.startswith(str(project / "runs" / ".code") + "/") and not Path(code).exists()  # dry run: unwritten
    assert f'export PYTHONPATH={shlex.quote(code)}"${{PYTHONPATH:+:$PYTHONPATH}}"' in out["none"]
    edf = out["edf"]
    assert "PYTHONSAFEPATH = \"1\"" in edf and code.replace('"', '\\"') in edf
    assert "--container-env=SLIPWAY_CODE,PYTHONPATH,PYTHONSAFEPATH" in out["pyxis"]
    assert f"{code}:{code}:ro" in out["pyxis"].replace("'\"'\"'", "'")
    sealed = slipway("submit", "tiny_cpu", "--dry-run", "container.runtime=edf", f"container.image={img}",
                     "code.snapshot=false")
    assert "SLIPWAY_CODE" not in sealed.stdout and "code.snapshot: false" in sealed.stdout


def test_shell_runs_the_checkouts_code_as_a_submission_now_would(project, tmp_path):
    """`slipway shell` mounts the checkout's code as the snapshot a submission now would run, in
    front of the image's trainer: the same snapshot, written for the shell, its files the checkout's."""
    checkout(project)
    mark(project, "shell")  # a change not in any image
    img = project / "img.sqsh"
    img.write_bytes(b"hsqs")
    bin_dir, seen = tmp_path / "bin", tmp_path / "srun-saw"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" "SLIPWAY_CODE=$SLIPWAY_CODE" "PYTHONPATH=$PYTHONPATH" '
                                  f'> {shlex.quote(str(seen))}\n')
    (bin_dir / "srun").chmod(0o755)
    args = ["tiny_cpu", "container.runtime=pyxis", f"container.image={img}"]
    r = subprocess.run([PY, "-m", "jobs", "shell", *args, "--command", "true"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert r.returncode == 0, r.stderr
    said = seen.read_text().splitlines()
    code = next(line for line in said if line.startswith("SLIPWAY_CODE=")).split("=", 1)[1]
    assert f"PYTHONPATH={code}" in said and any(f"{code}:{code}:ro" in line for line in said), said
    assert (Path(code) / "trainer" / "train.py").read_text() == (project / "trainer" / "train.py").read_text()
    assert not (project / "runs" / "tiny_cpu").exists()  # never into a run
    # Its notes as a dry run tells them: one line each, masked (a note quotes paths and overrides).
    told = [line for line in r.stderr.splitlines() if line.startswith("note: ")]
    assert told and set(told) < set(slipway("shell", *args, "--dry-run").stderr.splitlines()), r.stderr
    dry = slipway("submit", *args, "--dry-run")
    assert f"{code}:{code}:ro" in dry.stdout.replace("'\"'\"'", "'")  # the snapshot a submission now would run


def test_pyxis_keeps_the_container_of_a_known_build_only(project):
    """Under pyxis the steps share the image build's kept container (named by the squashfs's
    content hash); keep_builds 0, a registry image and the other runtimes get none; a bad
    keep_builds is one line naming it, exit 2."""
    img = project / "img.sqsh"
    img.write_bytes(b"hsqs")
    from common.fs import file_sha256

    def settings(*extra: str) -> str:
        r = slipway("submit", "tiny_cpu", "--dry-run", "container.runtime=pyxis", *extra)
        assert r.returncode == 0, r.stderr
        return next(line for line in r.stdout.splitlines() if line.startswith("CONTAINER_PREFIX="))

    # Named by the project too (containers/project.py): a job's sweep acts on this project's alone.
    from containers.context import build_root
    from containers.project import Project

    token = Project.of(build_root(project, "containers/Dockerfile")).token
    assert settings(f"container.image={img}") == (f"CONTAINER_PREFIX=slipway-{token}- "
                                                  f"CONTAINER_BUILD=i{file_sha256(img)[:16]} "
                                                  f"KEEP_BUILDS=3 IMAGE_IDENTITY={file_sha256(img)}")
    assert "CONTAINER_BUILD='' KEEP_BUILDS=0" in settings(f"container.image={img}", "container.keep_builds=0")
    assert "CONTAINER_BUILD=''" in settings("container.image=nvcr.io#nvidia/pytorch:25.01-py3")
    bad = slipway("submit", "tiny_cpu", "--dry-run", "container.runtime=pyxis", f"container.image={img}",
                  "container.keep_builds=-1")
    assert bad.returncode == 2 and "container.keep_builds" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # a minute: sinfo's own search for a controller when SLURM_CONF names no file
def test_the_containers_command_says_why_slurm_cannot_answer(project, tmp_path):
    """`slipway image containers` where no Slurm controller can be reached: Slurm's own words in
    one line, exit 1 (the input was fine), never an internal error."""
    if shutil.which("sinfo") is None or shutil.which("srun") is None:
        pytest.skip("the Slurm client commands are not installed")
    r = subprocess.run([PY, "-m", "jobs", "image", "containers", "tiny_cpu"], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "SLURM_CONF": str(tmp_path / "no-slurm.conf")})
    assert r.returncode == 1 and r.stderr.startswith("slipway: error: sinfo failed"), (r.stdout, r.stderr)
    assert "internal error" not in r.stderr


# ------------------------------------------------------------------ on the local Slurm


def job_state(job_id: str) -> str:
    r = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
    return next((w.split("=", 1)[1] for w in r.stdout.split() if w.startswith("JobState=")), "GONE")


def wait_end(job_id: str, timeout: float = 240) -> str:
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        state = job_state(job_id)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "GONE"):
            return state
        time.sleep(0.5)
    pytest.fail(f"job {job_id} did not end in {timeout} s")


TINY = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=2", "data.seq_len=64", "model.max_position_embeddings=64", "train.micro_batch_size=4",
        "train.steps=4", "train.eval_interval=0", "train.warmup_steps=1", "logging.interval=1",
        "checkpoint.interval=4", "slurm.preflight=false"]


@pytest.mark.slurm
def test_a_job_runs_the_code_it_was_submitted_with_through_a_requeue(project, slurm_env):
    checkout(project)
    mark(project, "one")
    # Held in the queue while the checkout changes under it.
    r = slipway("submit", "tiny_cpu", "--parsable", "--run-name", "old", *TINY, "slurm.extra=[--hold]")
    assert r.returncode == 0, r.stderr
    old_job = r.stdout.strip()
    mark(project, "two")
    subprocess.run(["scontrol", "release", old_job], check=True)
    assert wait_end(old_job) == "COMPLETED"
    runs = project / "runs"
    assert (runs / "old" / "code-marks").read_text() == "one\n"
    # A requeue runs the same snapshot, whatever the checkout holds now.
    subprocess.run(["scontrol", "requeue", old_job], check=True)
    assert wait_end(old_job) == "COMPLETED"
    assert (runs / "old" / "code-marks").read_text() == "one\none\n"

    r = slipway("submit", "tiny_cpu", "--parsable", "--run-name", "new", *TINY)
    assert r.returncode == 0, r.stderr
    assert wait_end(r.stdout.strip()) == "COMPLETED"
    assert (runs / "new" / "code-marks").read_text() == "two\n"
    old = json.loads((runs / "old" / "manifest.json").read_text())["code"]
    new = json.loads((runs / "new" / "manifest.json").read_text())["code"]
    assert old["hash"] != new["hash"] and "commit" not in old and Path(old["dir"]).is_dir()  # not a git checkout
    # Identical content is stored once: a third run of the same code shares the second's.
    r = slipway("submit", "tiny_cpu", "--dry-run", "--run-name", "same", *TINY)
    assert f"/runs/.code/{new['dir'][-16:]}" in r.stdout
    assert snapshots(runs / STORE) == sorted({old["dir"][-16:], new["dir"][-16:]})

    # The old run resubmitted with the new code: recorded, and said by status.
    r = slipway("submit", "tiny_cpu", "--parsable", "--run-name", "old", *TINY, "train.steps=6", "--force")
    assert r.returncode == 0, r.stderr
    again = r.stdout.strip()
    assert wait_end(again) == "COMPLETED"
    assert (runs / "old" / "code-marks").read_text() == "one\none\ntwo\n"
    events = (runs / "old" / "events.log").read_text()
    assert f"job {again} code changed {old['hash'][:12]} -> {new['hash'][:12]}" in events
    assert list((runs / "old" / "history").glob("code-*.json"))
    status = slipway("status", "old")
    assert f"code {new['hash'][:12]}" in status.stdout
    assert f"note: code changed at job {again}: {old['hash'][:12]} -> {new['hash'][:12]}" in status.stdout

    # The store keeps what runs name: with run `old` deleted, its first snapshot goes at the next
    # launch once its grace has passed (and the hour since the store's last pruning); the one
    # `new` names stays.
    shutil.rmtree(runs / "old")
    past = time.time() - PRUNE_AFTER_SECONDS - 60
    for entry in [*(runs / STORE).iterdir(), runs / f"{STORE}.pruned"]:
        os.utime(entry, (past, past))
    r = slipway("submit", "tiny_cpu", "--parsable", "--run-name", "after", *TINY)
    assert r.returncode == 0, r.stderr
    assert snapshots(runs / STORE) == [new["dir"][-16:]]
    assert wait_end(r.stdout.strip()) == "COMPLETED"


@pytest.mark.slurm
def test_a_snapshot_changed_after_submission_fails_the_job_before_training_naming_the_file(project, slurm_env):
    """Every node checks the code against the hash the job names: a file of the store edited while
    the job waits ends it with exit 2 before any training step, no retry, no node blamed."""
    checkout(project)
    r = slipway("submit", "tiny_cpu", "--parsable", "--run-name", "edited", "--nodes", "2", "--dp", "2",
                "launch.procs_per_node=1", *TINY, "slurm.extra=[--hold]")
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    run_dir = project / "runs" / "edited"
    code = json.loads((run_dir / "manifest.json").read_text())["code"]
    edited = Path(code["dir"]) / "trainer" / "train.py"
    edited.chmod(0o644)
    edited.write_text(edited.read_text() + "\nimport os  # an edit made in the store after submission\n")
    subprocess.run(["scontrol", "release", job], check=True)
    assert wait_end(job) == "FAILED"
    events = (run_dir / "events.log").read_text()
    assert f"job {job} verification failed: {edited} differs from the file submitted (on node" in events, events
    assert f"job {job} end exit 2" in events and "retry" not in events and "preflight" not in events
    assert not (run_dir / "metrics.jsonl").exists()  # no rank started
    status = slipway("status", "edited")
    assert "FAILED" in status.stdout and "differs from the file submitted" in status.stdout, status.stdout


def metrics_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r["step"] for r in map(json.loads, lines) if r.get("kind") == "train"]


@pytest.mark.slurm
def test_slipway_run_inside_an_allocation_stops_resumably_and_resumes(project, slurm_env):
    """`salloc -N2 slipway run ...`: the batch script's steps in the allocation; Ctrl-C saves and
    leaves the run resumable (exit 75); running it again resumes to the end."""
    import signal
    import time

    checkout(project)
    args = ["run", "tiny_cpu", "--run-name", "inter", "--nodes", "2", "--dp", "2", "launch.procs_per_node=1",
            *TINY, "train.steps=400",
            "checkpoint.interval=1000", "train.micro_batch_size=8"]
    proc = subprocess.Popen(["salloc", "--nodes=2", PY, "-m", "jobs", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ), preexec_fn=default_signals)
    run_dir = project / "runs" / "inter"
    deadline = time.time() + 180
    while time.time() < deadline and len(metrics_steps(run_dir)) < 3:
        time.sleep(0.5)
    assert len(metrics_steps(run_dir)) >= 3, proc.stdout.read() if proc.poll() is not None else "no steps"
    launcher = subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "jobs run"], capture_output=True, text=True)
    os.kill(int(launcher.stdout.split()[0]), signal.SIGINT)  # Ctrl-C to slipway run
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out[-3000:]
    saved = sorted(int(p.parent.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*/COMPLETE"))
    assert saved and 3 <= saved[-1] < 400, saved
    events = (run_dir / "events.log").read_text()
    assert "job local interrupted: stop requested" in events
    assert "job local stopped on request: saved after the stop request" in events, events
    assert "rank 0" not in out or "step" in out  # rank 0's log lines reached the terminal
    assert re.search(r"step\s+\d+", out), out[-2000:]
    # After the Ctrl-C: the launcher's answer and its report, nothing of torchrun's or srun's ending.
    lines = out.splitlines()
    said = [line for line in lines[next(i for i, line in enumerate(lines) if line.startswith("Ctrl-C: ")):]
            if not line.startswith("salloc: ")]
    assert len(said) == 2 and "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    assert said[1].startswith(f"interrupted (Ctrl-C) at step {saved[-1]} and saved it: `"), said
    assert " run tiny_cpu " in said[1] and "resumes from there" in said[1], said
    status = slipway("status", "inter")
    assert "STOPPED" in status.stdout.upper() and "75" in status.stdout, status.stdout

    # Again, with fewer steps left: it resumes from the saved step and completes.
    again = [a for a in args if not a.startswith("train.steps=")] + [f"train.steps={saved[-1] + 2}", "--force"]
    r = subprocess.run(["salloc", "--nodes=2", PY, "-m", "jobs", *again], capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-2000:])
    for noise in ("Traceback", "frame #", "Exception raised from", "ChildFailedError", "srun: error"):
        assert noise not in r.stdout + r.stderr, (noise, r.stdout[-3000:], r.stderr[-2000:])
    steps = metrics_steps(run_dir)
    assert steps[-1] == saved[-1] + 2 and "resum" in (r.stdout + r.stderr).lower()
    assert not (run_dir / "stop-requested").exists()


def mark_parent(project: Path, word: str) -> None:
    """Make the checkout's trainer append `WORD PARENT` to RUN/code-marks when rank 0 starts,
    PARENT its parent process's command line (a warm process's `warm.py serve ...`, or srun's task)."""
    text = (ROOT / "trainer" / "train.py").read_text()
    anchor = "    args = parser.parse_args(argv)\n"
    line = ("    if os.environ.get('RANK', '0') == '0':\n"
            "        parent = open(f'/proc/{os.getppid()}/cmdline').read().replace(chr(0), ' ')\n"
            f"        open(os.path.join(os.environ['SLIPWAY_RUN_DIR'], 'code-marks'), 'a').write("
            f"'{word} ' + str(os.getppid()) + ' ' + parent + '\\n')\n")
    (project / "trainer" / "train.py").write_text(text.replace(anchor, anchor + line, 1))


def losses(run_dir: Path) -> list[float]:
    path = run_dir / "metrics.jsonl"
    return [r["loss"] for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == "train"]


@pytest.mark.slurm
def test_warm_ranks_in_an_allocation(project, slurm_env):
    """`slipway run` in one allocation, 2 nodes x 2 ranks of 2 CPUs each (a GPU-like config, whose
    OMP_NUM_THREADS starts OpenBLAS's pool at import): the first run starts a warm process on each
    node and its ranks start from them, each rank's start told in events.log; the next, after a
    one-line code change, starts its ranks from the same ones with the new code, loss for loss as
    cold ranks train; a changed HF_HUB_OFFLINE starts them cold, said once on the terminal; Ctrl-C
    leaves nothing of the run's held, so the printed command resumes at once; a changed setting
    starts new warm processes and stops the old; --stop-warm and the allocation's end leave none."""
    import signal

    checkout(project)
    mark_parent(project, "one")
    alloc = subprocess.run(["salloc", "--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=2", "--no-shell"],
                           capture_output=True, text=True, check=True, timeout=120)
    job = alloc.stderr.split("Granted job allocation ")[1].split()[0]
    nodes = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True, text=True).stdout.strip()
    inside = {**os.environ, "SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": nodes, "SLURM_JOB_NUM_NODES": "2",
              "SLURM_JOB_CPUS_PER_NODE": "4(x2)"}
    with_preflight = [a for a in TINY if not a.startswith("slurm.preflight")]  # its node step starts warm too
    base = ["tiny_cpu", "--nodes", "2", "--dp", "4", "slurm.cpus_per_task=2", *with_preflight]

    def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([PY, "-m", "jobs", "run", *base, "train.steps=3", *args], capture_output=True, text=True,
                              timeout=400, env={**inside, **(env or {})})

    def warm_steps() -> list[str]:
        out = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"], capture_output=True, text=True).stdout
        return [line.split()[0] for line in out.splitlines() if line.split()[1:] and line.split()[1].startswith("slipway-warm-")]

    def servers() -> list[str]:
        """The warm processes of the allocation (not srun's line; not their forks: ranks, probes)."""
        pattern = rf"^[^ ]*python[^ ]* .*warm\.py serve .*/slipway-warm-{os.getuid()}/{job}-"
        found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        parents = {pid: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1] for pid in found
                   if Path(f"/proc/{pid}/stat").exists()}
        return [pid for pid, parent in parents.items() if parent not in found]

    def left() -> list[str]:
        """What of the allocation's is in the warm processes' folder on the nodes (the suite's, tests/conftest.py)."""
        return [p.name for p in (Path(os.environ["SLIPWAY_WARM_DIR"]) / f"slipway-warm-{os.getuid()}").glob(f"{job}[.-]*")]

    def starts(run_name: str) -> list[str]:
        return sorted(line.split(" warm: ", 1)[1] for line in (runs / run_name / "events.log").read_text().splitlines()
                      if " warm: rank " in line)

    warm = [f"rank {r} on node{1 + r // 2} started warm" for r in range(4)]
    runs = project / "runs"
    try:
        first = run("--run-name", "w1")
        assert first.returncode == 0, (first.stdout[-3000:], first.stderr[-3000:])
        assert "job local warm: started the warm processes on node1 node2" in (runs / "w1" / "events.log").read_text()
        assert starts("w1") == warm and "started cold" not in first.stdout  # its ranks waited for the imports
        (word, parent, cmdline), = [line.split(" ", 2) for line in (runs / "w1" / "code-marks").read_text().splitlines()]
        assert word == "one" and "warm.py serve " in cmdline, cmdline
        steps = warm_steps()
        assert len(steps) == 1 and len(servers()) == 2, (steps, servers())

        mark_parent(project, "two")  # a one-line change: the same warm processes, the new code
        second = run("--run-name", "w2")
        assert second.returncode == 0, (second.stdout[-3000:], second.stderr[-3000:])
        assert starts("w2") == warm, (runs / "w2" / "events.log").read_text()
        # Its node checks ran in the warm processes, asked from the host with the verification: no
        # node step of their own.
        said = "".join(log.read_text() for log in (runs / "w2" / "logs").glob("run-*.out"))
        assert len(re.findall(r"slipway-warm node\d: the node step started warm \(pid \d+, asked from the host\)", said)) == 2
        assert len(re.findall(r"slipway-preflight node\d ok: ", said)) == 2, said[-3000:]
        (word2, parent2, _), = [line.split(" ", 2) for line in (runs / "w2" / "code-marks").read_text().splitlines()]
        assert word2 == "two" and parent2 == parent and warm_steps() == steps  # reused
        # Cold ranks of the same code and config train loss for loss alike: nothing of the warm
        # process's state reached the training.
        cold = run("--run-name", "w2cold", "launch.warm=false")
        assert cold.returncode == 0, (cold.stdout[-3000:], cold.stderr[-3000:])
        (_, parent_cold, cmdline_cold), = [line.split(" ", 2) for line in (runs / "w2cold" / "code-marks").read_text().splitlines()]
        assert "warm.py" not in cmdline_cold and parent_cold != parent
        assert losses(runs / "w2") == losses(runs / "w2cold") and len(losses(runs / "w2")) == 3

        # The shell's environment changed what an import reads: cold, said once, each rank in events.log.
        offline = run("--run-name", "w2hf", env={"HF_HUB_OFFLINE": "1"})
        assert offline.returncode == 0, (offline.stdout[-3000:], offline.stderr[-3000:])
        said = [line for line in offline.stdout.splitlines() if "started cold" in line]
        assert said == [f"warm: {said[0].split('warm: ', 1)[1].split(' started cold')[0]} started cold: its environment "
                        "differs from the warm process's in HF_HUB_OFFLINE (each rank's start: events.log)"], said
        assert len([s for s in starts("w2hf") if s.endswith("in HF_HUB_OFFLINE")]) == 4

        # Ctrl-C of a run that started warm processes (a key of its own), then the printed command at
        # once: nothing of the run's is held by them (their srun held its lock for the allocation's life).
        proc = subprocess.Popen([PY, "-m", "jobs", "run", *base, "train.steps=400", "--run-name", "ctl",
                                 "launch.env.SLIPWAY_TEST_KNOB=ctl"], env=inside, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, preexec_fn=default_signals)
        deadline = time.time() + 180
        while time.time() < deadline and len(metrics_steps(runs / "ctl")) < 3 and proc.poll() is None:
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 75 and servers(), (out[-3000:], servers())
        assert "warm: started the warm processes on node1 node2" in (runs / "ctl" / "events.log").read_text()
        free = subprocess.run(["flock", "-n", str(runs / ".ctl.lock"), "true"])
        assert free.returncode == 0, subprocess.run(["fuser", "-v", str(runs / ".ctl.lock")], capture_output=True, text=True)
        resume = out.split("saved it: `", 1)[1].split("`", 1)[0]
        again = subprocess.run(f"{resume} train.steps={metrics_steps(runs / 'ctl')[-1] + 1} --force", shell=True,
                               capture_output=True, text=True, timeout=400, env=inside, cwd=project)
        assert again.returncode == 0 and "resum" in again.stdout.lower(), (again.stdout[-3000:], again.stderr[-2000:])
        deadline = time.monotonic() + 60
        while len(warm_steps()) != 1:  # the first key's, asked to stop by the run of another
            assert time.monotonic() < deadline, warm_steps()
            time.sleep(0.5)
        steps = warm_steps()

        # A changed config is refused without --force, as without warm processes.
        refused = run("--run-name", "w2", "train.steps=4")
        assert refused.returncode == 2 and "exists with" in refused.stderr, refused.stderr

        # A setting the warm processes were started with changed: new ones, the old asked to stop.
        renewed = run("--run-name", "w3", "launch.env.SLIPWAY_TEST_KNOB=1")
        assert renewed.returncode == 0, (renewed.stdout[-3000:], renewed.stderr[-3000:])
        events = (runs / "w3" / "events.log").read_text()
        assert f"warm: stopping the warm processes of step {steps[0]} (another key)" in events, events
        assert "warm: started the warm processes on node1 node2" in events
        (_, parent3, _), = [line.split(" ", 2) for line in (runs / "w3" / "code-marks").read_text().splitlines()]
        assert parent3 != parent
        deadline = time.monotonic() + 60
        while len(warm_steps()) != 1 or warm_steps() == steps:
            assert time.monotonic() < deadline, warm_steps()
            time.sleep(0.5)

        stop = subprocess.run([PY, "-m", "jobs", "run", "--stop-warm"], capture_output=True, text=True, env=inside)
        assert stop.returncode == 0 and "asked 1 warm step(s)" in stop.stdout, (stop.stdout, stop.stderr)
        while warm_steps() or servers():
            assert time.monotonic() < deadline + 60, (warm_steps(), servers())
            time.sleep(0.5)
        assert not left(), left()  # their sockets, locks and the allocation's secret

        # Started again, then the allocation ends: none outlives it.
        again = run("--run-name", "w4")
        assert again.returncode == 0 and len(servers()) == 2, (again.stderr[-2000:], servers())
    finally:
        subprocess.run(["scancel", job])
    deadline = time.monotonic() + 90
    while servers():
        assert time.monotonic() < deadline, f"warm processes outlived allocation {job}: {servers()}"
        time.sleep(0.5)
    assert not left(), left()


@pytest.mark.slurm
def test_where_slurm_tracks_processes_by_cgroup_slipway_run_says_so_once_and_ranks_start_cold(project, monkeypatch):
    """proctrack/cgroup and task/cgroup, as every production Slurm runs (here Debian's Slurm on
    cgroup v1, a cgroup root per node): a rank forked by a warm process would be the warm step's,
    outside its own step's accounting and its memory and device limits. `slipway run` keeps no warm
    processes there, says so once, and every rank starts in the training step's own cgroups."""
    import jobs.devcluster.daemons as daemons
    from jobs.devcluster import ClusterSpec, LocalSlurmCluster, default_state_dir, unavailable_reason

    if reason := unavailable_reason():
        pytest.skip(reason)
    linuxproc = daemons.render_slurm_conf

    def with_cgroups(spec: ClusterSpec) -> str:
        (spec.conf.parent / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nConstrainCores=yes\n"
                                                       "ConstrainRAMSpace=yes\nConstrainDevices=yes\n")
        return linuxproc(spec).replace("ProctrackType=proctrack/linuxproc", "ProctrackType=proctrack/cgroup") \
            .replace("TaskPlugin=task/none", "TaskPlugin=task/cgroup,task/affinity")

    monkeypatch.setattr(daemons, "render_slurm_conf", with_cgroups)
    cluster = LocalSlurmCluster(ClusterSpec(state_dir=default_state_dir("pytest-cgroup"), nodes=2, name="slpwcg",
                                            node_prefix="cgnode", ctl_host="slpwcg-ctl", subnet="10.213.7",
                                            ctld_port=6927, slurmd_port=6928))
    checkout(project)
    text = (ROOT / "trainer" / "train.py").read_text()
    anchor = "    args = parser.parse_args(argv)\n"
    (project / "trainer" / "train.py").write_text(text.replace(anchor, anchor + (
        "    open(os.path.join(os.environ['SLIPWAY_RUN_DIR'], f\"cgroup-{os.environ['RANK']}\"), 'w').write("
        "open('/proc/self/cgroup').read())\n"), 1))
    cluster.up()
    try:
        env = {**os.environ, **cluster.env()}
        r = subprocess.run(["salloc", "--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=2", PY, "-m", "jobs", "run",
                            "tiny_cpu", "--run-name", "cg", "--nodes", "2", "--dp", "4", "slurm.cpus_per_task=2",
                            *[a for a in TINY if not a.startswith("slurm.preflight")], "train.steps=2"],
                           capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
        assert r.stdout.count("warm ranks are off here") == 1 and "started warm" not in r.stdout, r.stdout
        events = (project / "runs" / "cg" / "events.log").read_text()
        assert "warm: off: Slurm tracks this job's processes by cgroup" in events and "warm: rank" not in events
        for rank in range(4):
            freezer = next(line for line in (project / "runs" / "cg" / f"cgroup-{rank}").read_text().splitlines()
                           if ":freezer:" in line)
            assert re.search(r"/job_\d+/step_\d+$", freezer), freezer  # its own step's, the training step
        doctor = subprocess.run([PY, "-m", "jobs", "doctor", "tiny_cpu"], capture_output=True, text=True, timeout=300,
                                env={**env, "COLUMNS": "400"})
        assert "warm ranks" in doctor.stdout and "ProctrackType=proctrack/cgroup" in doctor.stdout, doctor.stdout
    finally:
        cluster.down(check=False)
