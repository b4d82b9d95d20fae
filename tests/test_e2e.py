"""End to end on a real multi-node Slurm cluster (jobs/devcluster/: node1, node2 in
their own network namespaces): training over 2 nodes with dp x tp and dp x pp, the
time-limit warning (save, requeue, resume, same losses), a dead rank (bounded
failure, intact checkpoint, resume on resubmission), rendezvous ports of
concurrent jobs, and 20 submissions at once.

Every case uses the smallest model and step count that still shows the behaviour.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PY = sys.executable

# The smallest Llama that still trains visibly on CPUs with gloo.
TINY = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=2", "data.seq_len=64", "model.max_position_embeddings=64",
        "train.micro_batch_size=4", "train.steps=12", "train.eval_interval=0", "train.warmup_steps=2",
        "logging.interval=1", "checkpoint.interval=4"]


def slipway(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "jobs", *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ))


def submit(*args: str, timeout: float = 240) -> str:
    """`slipway submit` without following; returns the job id."""
    r = slipway("submit", "tiny_cpu", "--parsable", *args, timeout=timeout)
    assert r.returncode == 0, (r.stdout, r.stderr)
    return r.stdout.strip()


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl (a resumed run's later lines win)."""
    path = run_dir / "metrics.jsonl"
    out: dict[int, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") == "train":
                out[rec["step"]] = rec["loss"]
    return out


def steps_logged(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r["step"] for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == "train"]


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


def job_state(job_id: str) -> str:
    r = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
    m = re.search(r"JobState=(\S+)", r.stdout)
    return m.group(1) if m else "GONE"


FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED", "GONE"}


def wait_job_end(job_id: str, timeout: float) -> str:
    return wait_for(lambda: (s := job_state(job_id)) in FINISHED and s, timeout, f"job {job_id} to end", poll=0.5)


def complete_checkpoints(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*/COMPLETE"))


def sigkill_one_worker(run_name: str) -> tuple[int, str, str]:
    """SIGKILL one trainer worker (not torchrun itself, nor the wrapper reporting its exit) of the
    run; returns its pid, its rank and its node (its environment says)."""
    r = subprocess.run(["pgrep", "-f", f"trainer --config .*runs/{run_name}/config.yaml"],
                       capture_output=True, text=True)
    pids = [int(p) for p in r.stdout.split()]
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if (b"torch.distributed.run" not in cmdline and b"-m" in cmdline
                and Path(cmdline[0].decode()).name.startswith("python")):
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
            os.kill(pid, signal.SIGKILL)
            return pid, env[b"RANK"].decode(), env[b"SLURMD_NODENAME"].decode()
    pytest.fail(f"no trainer worker of {run_name} among {pids}")


# ------------------------------------------------------------------ 1. training over 2 nodes


@pytest.mark.slurm
@pytest.mark.parametrize("layout", [
    ["--dp", "2", "--tp", "2"],
    ["--dp", "2", "--pp", "2", "model.tie_embeddings=false", "train.grad_accum_steps=2"],
], ids=["dp2xtp2", "dp2xpp2"])
def test_two_nodes_train_to_completion(project, slurm_env, layout):
    name = "e2e-" + "-".join(a.strip("-") for a in layout[:4])
    r = slipway("submit", "tiny_cpu", "--run-name", name, "--nodes", "2", *layout, *TINY, "--show-logs")
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    run_dir = project / "runs" / name
    loss = losses(run_dir)
    assert sorted(loss) == list(range(1, 13)), loss
    assert loss[12] < loss[1], loss
    assert complete_checkpoints(run_dir)[-1] == 12
    job_id = json.loads((run_dir / "manifest.json").read_text())["submissions"][0]["job_id"]
    status = slipway("status", name)
    assert status.returncode == 0 and job_id in status.stdout and "COMPLETED" in status.stdout, status.stdout
    assert f"job {job_id} start on node[1-2]" in (run_dir / "events.log").read_text()


# ------------------------------------------------------------------ 2. time-limit warning


SLOW = ["train.steps=24", "train.micro_batch_size=16", "checkpoint.interval=100"]


@pytest.mark.slurm
def test_time_limit_warning_saves_requeues_and_resumes_exactly(project, slurm_env):
    # The reference: the same config, uninterrupted.
    ref = slipway("submit", "tiny_cpu", "--run-name", "ref", *TINY, *SLOW, "--show-logs")
    assert ref.returncode == 0, (ref.stdout[-3000:], ref.stderr[-3000:])
    reference = losses(project / "runs" / "ref")
    assert sorted(reference) == list(range(1, 25))

    run_dir = project / "runs" / "warned"
    job_id = submit("--run-name", "warned", *TINY, *SLOW)
    wait_for(lambda: len(steps_logged(run_dir)) >= 3, 120, "three logged steps")
    # Exactly what Slurm does for --signal=B:USR1@N when the time limit nears.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
    wait_for(lambda: "requeueing" in (run_dir / "events.log").read_text(), 120, "the batch script to requeue")
    # A requeued job may not start before the credential lifetime (AuthInfo cred_expire,
    # 120 s by default) has passed; let this one start sooner. Within the second of the
    # requeue its old credential counts as revoked and slurmd would refuse the start.
    wait_for(lambda: job_state(job_id) == "PENDING", 60, "the job to be pending again")
    time.sleep(3)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True, capture_output=True)
    wait_for(lambda: "restart 1" in (run_dir / "events.log").read_text(), 60, "the requeued job to start")
    assert wait_job_end(job_id, 180) == "COMPLETED"

    events = (run_dir / "events.log").read_text()
    assert "time limit warning: stop requested" in events and "requeueing" in events, events
    assert f"job {job_id} start on" in events and "(restart 1)" in events
    saved = [s for s in complete_checkpoints(run_dir) if s < 24]
    assert saved, "no checkpoint was saved at the stop request"
    stop_step = saved[0]
    logged = steps_logged(run_dir)
    # The second run starts right after the checkpoint it resumed from.
    assert logged[logged.index(stop_step) + 1] == stop_step + 1, logged
    assert 0 < stop_step < 24 and logged[-1] == 24
    got = losses(run_dir)
    assert sorted(got) == sorted(reference)
    for step in reference:
        assert got[step] == pytest.approx(reference[step], abs=1e-6), (step, got[step], reference[step])


# ------------------------------------------------------------------ 3. a rank dies


@pytest.mark.slurm
def test_dead_rank_fails_fast_and_resubmission_resumes(project, slurm_env):
    args = ["--run-name", "killed", "--nodes", "2", "--dp", "4", *TINY, *SLOW, "checkpoint.interval=2"]
    run_dir = project / "runs" / "killed"
    job_id = submit(*args)
    wait_for(lambda: complete_checkpoints(run_dir) and len(steps_logged(run_dir)) >= 3, 150,
             "a checkpoint and three logged steps")
    _, rank, node = sigkill_one_worker("killed")
    killed_at = time.time()
    state = wait_job_end(job_id, 120)
    assert time.time() - killed_at < 120
    assert state == "FAILED", state
    saved = complete_checkpoints(run_dir)
    assert saved and saved[-1] < 24
    last = saved[-1]
    marker = json.loads((run_dir / "checkpoints" / f"step-{last:06d}" / "COMPLETE").read_text())
    assert marker["step"] == last
    # What ended it: the rank, its node and the signal, in events.log and `status RUN`, with the
    # job's elapsed time (events.log settles the end: Slurm is not asked).
    said = f"rank failed: rank {rank} on {node} was killed by SIGKILL (exit 137)"
    assert f"job {job_id} {said}" in (run_dir / "events.log").read_text()
    status = subprocess.run([PY, "-m", "jobs", "status", "killed"], capture_output=True, text=True, timeout=240,
                            env={**os.environ, "COLUMNS": "400"})  # a table row on one line
    row = next(line for line in status.stdout.splitlines() if job_id in line)
    assert "FAILED" in row and "137" in row and re.search(r"\d\d:\d\d:\d\d", row), status.stdout
    assert f"rank {rank} on {node} was killed by SIGKILL" in row, status.stdout

    resubmit_resumes(run_dir, args, last, 24)


def resubmit_resumes(run_dir: Path, args: list[str], last: int, steps: int) -> None:
    """`slipway submit` again with `args` (--show-logs): the run resumes right after checkpoint
    `last` and trains to `steps`, its final checkpoint saved."""
    again = slipway("submit", "tiny_cpu", *args, "--show-logs")
    assert again.returncode == 0, (again.stdout[-3000:], again.stderr[-3000:])
    assert "resubmitted" in again.stdout
    logged = steps_logged(run_dir)
    restart = max(i for i, s in enumerate(logged) if i and s <= logged[i - 1])
    assert logged[restart] == last + 1, (last, logged)
    assert logged[-1] == steps and complete_checkpoints(run_dir)[-1] == steps


# ------------------------------------------------------------------ 4. rendezvous


@pytest.mark.slurm
def test_concurrent_jobs_get_distinct_rendezvous(project, slurm_env):
    show = ("import os; print('RDZV', os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'], flush=True); "
            "import time; time.sleep(4)")
    common = ["--nodes", "2", "launch.procs_per_node=1", "--dp", "1", "--cpus-per-task", "1",
              "launch.launcher=srun", f"launch.command=[{PY}, -c, {json.dumps(show)}]"]
    jobs = {name: submit("--run-name", name, *common) for name in ("rdzv-a", "rdzv-b")}
    # Both hold the same 2 nodes at once (2 of 4 CPUs each).
    wait_for(lambda: all(job_state(j) == "RUNNING" for j in jobs.values()), 60, "both jobs running together")
    seen = {}
    for name, job_id in jobs.items():
        assert wait_job_end(job_id, 60) == "COMPLETED"
        out = (project / "runs" / name / "logs" / f"{job_id}.out").read_text()
        rdzv = {tuple(line.split()[1:3]) for line in out.splitlines() if line.startswith("RDZV")}
        assert len(rdzv) == 1, out
        seen[name] = rdzv.pop()
    addrs = {a for a, _ in seen.values()}
    ports = {p for _, p in seen.values()}
    assert addrs <= {"node1", "node2"}, seen
    assert len(ports) == 2, seen


# ------------------------------------------------------------------ 5. load


@pytest.mark.slurm
def test_twenty_submissions_at_once(project, slurm_env):
    code = ("import os, pathlib; d = pathlib.Path(os.environ['SLIPWAY_RUN_DIR']); "
            "(d / 'owner').write_text(os.environ['SLURM_JOB_ID'])")
    common = ["launch.procs_per_node=1", "--dp", "1", "launch.launcher=srun",
              f"launch.command=[{PY}, -c, {json.dumps(code)}]"]
    names = [f"load-{i:02d}" for i in range(20)]
    procs = {n: subprocess.Popen([PY, "-m", "jobs", "submit", "tiny_cpu", "--parsable", "--run-name", n, *common],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in names}
    job_ids = {}
    for n, p in procs.items():
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, (n, out, err)
        job_ids[n] = out.strip()
    assert len(set(job_ids.values())) == 20
    runs = project / "runs"
    assert sorted(p.name for p in runs.iterdir() if p.is_dir() and not p.name.startswith(".")) == names  # not .code
    for n, job_id in job_ids.items():
        subs = json.loads((runs / n / "manifest.json").read_text())["submissions"]
        assert [s["job_id"] for s in subs] == [job_id], (n, subs)
    deadline = time.time() + 180
    for n, job_id in job_ids.items():
        assert wait_job_end(job_id, max(1.0, deadline - time.time())) == "COMPLETED", n
    for n, job_id in job_ids.items():
        d = runs / n
        assert (d / "owner").read_text() == job_id
        # No file of another run: every log and event of this run names only its own job.
        assert {p.name.split(".")[0] for p in (d / "logs").iterdir()} == {job_id}
        assert {line.split()[2] for line in (d / "events.log").read_text().splitlines()} == {job_id}


# ------------------------------------------------------------------ 6. paths the container would use


@pytest.mark.slurm
def test_job_reaches_its_paths_from_any_working_directory(project, slurm_env):
    """The frozen config names every path absolutely, as a container that starts elsewhere sees
    it: relative dataset and token cache, and every rank starting in / instead of the project."""
    corpus = write_corpus(project)
    r = slipway("submit", "tiny_cpu", "--run-name", "elsewhere", "--nodes", "2", "--dp", "4", *TINY, "train.steps=3",
                "data.dataset=./corpus", "data.cache_dir=tok cache", "data.validation_fraction=0",
                "launch.pre_launch=[cd /]", "--prepare",
                "--show-logs")
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    run_dir = project / "runs" / "elsewhere"
    from trainer.config import load_trainer_config

    frozen = load_trainer_config(run_dir / "config.yaml").data
    assert frozen.dataset == str(corpus) and frozen.cache_dir == str(project / "tok cache")
    assert any((project / "tok cache").iterdir())  # the cache the job wrote, by its absolute path
    assert sorted(losses(run_dir)) == [1, 2, 3]
    assert not (Path("/") / "tok cache").exists() and not (Path("/") / "runs").exists()


# ------------------------------------------------------------------ 7. data prepared before the allocation


def write_corpus(project: Path, column: str = "text") -> Path:
    corpus = project / "corpus"
    corpus.mkdir(exist_ok=True)
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (corpus / "docs.jsonl").write_text("".join(json.dumps({column: text[i:i + 400]}) + "\n"
                                               for i in range(0, len(text), 150)))
    return corpus


@pytest.mark.slurm
def test_prepared_data_is_only_opened_by_the_job(project, slurm_env):
    write_corpus(project, "body")
    data = ["--dataset", "./corpus", "--text-column", "body", "--tokenizer", "builtin"]
    refused = slipway("submit", "tiny_cpu", "--run-name", "prep", *TINY, "train.steps=2", *data)
    assert refused.returncode == 2 and "slipway prepare tiny_cpu" in refused.stderr, refused.stderr
    assert not (project / "runs" / "prep").exists()
    prep = slipway("prepare", "tiny_cpu", *data)
    assert prep.returncode == 0 and "5," in prep.stdout or "tokens" in prep.stdout, (prep.stdout, prep.stderr)
    r = slipway("submit", "tiny_cpu", "--run-name", "prep", *TINY, "train.steps=2", *data, "--show-logs")
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "opened the token cache" in r.stdout + r.stderr and "tokenizing" not in r.stdout + r.stderr
    first = [json.loads(line) for line in (project / "runs" / "prep" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line).get("kind") == "train"][0]
    assert first["data_time_s"] < 0.5, first


@pytest.mark.slurm
def test_submit_prepare_runs_the_preparation_first(project, slurm_env):
    write_corpus(project)
    r = slipway("submit", "tiny_cpu", "--run-name", "queued", *TINY, "train.steps=2", "data.dataset=./corpus",
                "--prepare", "--show-logs")
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    run_dir = project / "runs" / "queued"
    subs = json.loads((run_dir / "manifest.json").read_text())["submissions"]
    assert [s["kind"] for s in subs] == ["prepare", "train"] and subs[1]["after"] == subs[0]["job_id"]
    events = (run_dir / "events.log").read_text().splitlines()
    prep_end = next(i for i, line in enumerate(events) if f"job {subs[0]['job_id']} prepare end exit 0" in line)
    train_start = next(i for i, line in enumerate(events) if f"job {subs[1]['job_id']} start on" in line)
    assert prep_end < train_start, events
    assert "tokens" in (run_dir / "logs" / f"prepare-{subs[0]['job_id']}.out").read_text()
    assert "opened the token cache" in r.stdout + r.stderr
    assert sorted(losses(run_dir)) == [1, 2]
    # A second run of the same data finds it prepared: no preparation job.
    again = slipway("submit", "tiny_cpu", "--run-name", "again", *TINY, "train.steps=1", "data.dataset=./corpus",
                    "--prepare")
    assert again.returncode == 0 and "preparation job" not in again.stdout, again.stdout
