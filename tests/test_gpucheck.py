"""`slipway gpu-check` on the CPU (issue 40's proof there): every part that needs no CUDA runs
through the command a user types, with a tiny model and two processes standing for two GPUs;
the time budgets stop a slow step and skip the rest of its part, saying so; bad input is one
line and exit 2 with nothing written. Its GPU half is the same command on a GPU node."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs.gpucheck.check import Check, Part
from jobs.gpucheck.report import render_markdown
from trainer_helpers import ROOT, clean_env

PARTS = ["node", "correctness", "training", "allreduce", "speed"]


def gpu_check(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs", "gpu-check", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900, env=clean_env(COLUMNS="200", **(env or {})))


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("slipway: error: "), line
    return line


# Budgets no loaded machine runs out of: what the budgets do is tested apart, structurally.
AMPLE = [f"--budget={part}=1800" for part in PARTS]


@pytest.fixture(scope="module")
def cpu_check(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, dict]:
    out = tmp_path_factory.mktemp("check") / "out dir 'q' $(x)"
    proc = gpu_check("--device", "cpu", "--out", str(out), *AMPLE)
    return out, proc, json.loads((out / "report.json").read_text())


# ---- the whole check, on the CPU ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiproc
def test_every_part_runs_on_the_cpu_and_the_report_says_what_ran(cpu_check):
    out, proc, report = cpu_check
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert [p["name"] for p in report["parts"]] == PARTS
    assert all(p["status"] == "ok" for p in report["parts"]), [(p["name"], p["status"]) for p in report["parts"]]
    assert report["verdict"] == "passed" and report["device"] == "cpu" and report["devices"] == 2
    failed = [c for p in report["parts"] for c in p["checks"] if not c["ok"]]
    assert not failed, failed
    parts = {p["name"]: p for p in report["parts"]}
    # What does not run on the CPU is named, with the reason.
    skipped = {s["what"]: s["why"] for s in parts["speed"]["skipped"]}
    assert skipped == {f"{c}, compiled": "on the CPU only eager runs: train.compile compiles on CUDA"
                       for c in ("ours", "bare")}
    assert parts["correctness"]["skipped"] == [{"what": "flash-attn against the math path",
                                                "why": "flash-attn is not installed here"}]
    node = parts["node"]["results"]
    assert node["torch"].startswith("2.") and not node["cuda_available"] and node["numa"]
    assert node["environment"]["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    md = (out / "report.md").read_text()
    for heading in PARTS:
        assert f"\n## {heading}\n" in md
    assert md.startswith("# slipway gpu-check: ") and "**passed**: " in md
    assert "- `PYTORCH_ALLOC_CONF=expandable_segments:True`" in md
    assert "- skipped: ours, compiled: on the CPU only eager runs: train.compile compiles on CUDA" in md
    # Each step's output is kept for whoever reads why.
    logs = sorted(p.name for p in (out / "work" / "logs").iterdir())
    assert "training-resumed-from-step-4.log" in logs and "speed-ours-eager.log" in logs
    # ...but no checkpoint of a speed case: its last step's save is no result, and on a GPU the tiny
    # preset's is 1.3 GB of the node's scratch each
    speed_runs = [p for p in (out / "work" / "speed").iterdir() if (p / "metrics.jsonl").is_file()]
    assert speed_runs and not [p for p in speed_runs if (p / "checkpoints").exists()], speed_runs


@pytest.mark.slow
@pytest.mark.multiproc
def test_slipway_local_resumes_exactly_and_tp_trains_what_dp_does(cpu_check):
    out, _, report = cpu_check
    training = next(p for p in report["parts"] if p["name"] == "training")
    losses = training["results"]["losses"]
    first, resumed, tp = losses["first attempt"], losses["resumed"], losses["dp 1 x tp 2"]
    assert sorted(map(int, first)) == list(range(1, 9)) and sorted(map(int, resumed)) == [5, 6, 7, 8]
    assert all(resumed[s] == first[s] for s in resumed)  # bit for bit
    assert all(abs(tp[s] - first[s]) <= 1e-4 * abs(first[s]) for s in first)
    checks = {c["what"]: c["detail"] for c in training["checks"]}
    assert checks["exact resume"] == "the losses of steps 5-8 are the first attempt's, bit for bit"
    assert checks["checkpoints"] == "complete at steps [4, 8]"
    assert checks["hang watchdog"].startswith("on (train.hang_timeout 600.0 s), no hang")
    # Through the real launch: the run's own records say so.
    run = out / "work" / "runs" / "gpucheck-dp"
    events = (run / "events.log").read_text()
    assert events.count("start on this machine") == 2 and events.count("end exit 0") == 2
    restarts = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                if '"restart"' in line]
    assert [r["step"] for r in restarts] == [0, 4] and restarts[0]["world_size"] == 2


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_same_directory_again_replaces_the_previous_check(cpu_check):
    out, _, _ = cpu_check
    (out / "work" / "stale").write_text("from the check before")
    proc = gpu_check("--device", "cpu", "--out", str(out), *(f"--budget={p}=1" for p in PARTS[1:]))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (out / "work" / "stale").exists()
    report = json.loads((out / "report.json").read_text())
    assert [p["status"] for p in report["parts"]] == ["ok", "skipped", "skipped", "skipped", "skipped"]


# ---- budgets -----------------------------------------------------------------------------


@pytest.mark.slow
def test_parts_without_the_time_for_a_step_are_skipped_with_the_reason(tmp_path):
    out = tmp_path / "out"
    proc = gpu_check("--device", "cpu", "--out", str(out), "--budget", "correctness=1", "--budget", "training=2.5",
                     "--budget", "allreduce=0.5", "--budget", "speed=1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert [p["status"] for p in report["parts"]] == ["ok", "skipped", "skipped", "skipped", "skipped"]
    assert report["verdict"] == "passed what ran" and report["budgets"]["training"] == 2.5
    training = report["parts"][2]
    assert training["skipped"][0] == {"what": "FSDP2 over 2", "why": "not started: 2 s of the part's 2.5 s budget was "
                                      "left, less than a step's 3 s"}
    assert training["skipped"][1] == {"what": "resumed from step 4",
                                      "why": "not started: the part's budget ran out at 'FSDP2 over 2'"}
    assert "- skipped: resumed from step 4: not started: the part's budget ran out at 'FSDP2 over 2'" in \
        (out / "report.md").read_text()


def test_a_step_past_its_budget_is_stopped_with_its_process_group(tmp_path):
    """A step that would run for a minute (a shell and its child) is stopped at its part's
    deadline: both processes are gone, its output kept, the part's later steps skipped."""
    check = Check(tmp_path, {"speed": 4.0}, console=None)
    (check.work / "logs").mkdir(parents=True)
    pids: list[int] = []

    def slow(part: Part) -> None:
        try:
            check.run(part, "slow step", ["sh", "-c", "sleep 60 & echo $!; wait"])
        finally:
            pids.extend(int(x) for x in (check.work / "logs" / "speed-slow-step.log").read_text().split())

    part = check.run_part("speed", [("slow step", slow), ("later", lambda part: None)])
    assert part.skipped == [{"what": "slow step", "why": "stopped: it ran past the part's 4 s budget"},
                            {"what": "later", "why": "not started: the part's budget ran out at 'slow step'"}]
    assert part.status == "skipped" and len(pids) == 1
    assert not _alive(pids[0])  # the child too: the whole group was stopped
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["parts"][0]["skipped"] == part.skipped


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_slipway_local_stopped_mid_run_takes_its_trainer_with_it(tmp_path):
    """How the training part stops a launch past its budget: slipway local is interrupted twice
    (stop now) and its trainer, in a session of its own, ends with it; the launch says so."""
    from jobs.gpucheck.check import stop_group
    from jobs.gpucheck.parts import GpuCheck

    check = GpuCheck(tmp_path, {}, console=None)
    check.start("cpu", 0)
    config = check.training_config("long", dp=2, tp=1)
    config.write_text(config.read_text().replace("steps: 8", "steps: 100000"))
    env = clean_env(SLIPWAY_PROJECT=str(check.work), SLIPWAY_RUNS=str(check.runs))
    proc = subprocess.Popen([sys.executable, "-m", "jobs", "local", str(config), "--yes"], cwd=check.work, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    metrics, patience = check.runs / "long" / "metrics.jsonl", time.monotonic() + 600
    while proc.poll() is None and '"kind": "train"' not in (metrics.read_text() if metrics.exists() else ""):
        assert time.monotonic() < patience, "slipway local trained no step in 10 minutes"
        time.sleep(0.2)  # until it trains
    stop_group(proc, interrupt=True)
    assert proc.wait(60) == 130
    (launch,) = json.loads((check.runs / "long" / "manifest.json").read_text())["submissions"]
    assert launch["exit"] == "interrupted" and not _alive(launch["trainer_pid"])
    assert not _session_members(launch["trainer_pid"])  # no rank left behind


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def _session_members(sid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


# ---- bad input: one line, exit 2, nothing written -------------------------------------------


@pytest.mark.parametrize("args, field", [
    (["--budget", "speed"], "--budget"), (["--budget", "speed=-3"], "--budget"), (["--budget", "gpus=10"], "--budget"),
    (["--budget", "speed=$(x)"], "--budget"),
])
def test_bad_budgets_are_one_line(tmp_path, args, field):
    line = one_error_line(gpu_check("--device", "cpu", "--out", str(tmp_path / "out"), *args))
    assert f"error: {field}: " in line and "PART=SECONDS" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_cuda_asked_where_torch_sees_none_is_one_line_and_writes_nothing(tmp_path):
    line = one_error_line(gpu_check("--device", "cuda", "--out", str(tmp_path / "out")))
    assert "--device: torch sees no CUDA device on this node (torch 2." in line and "--device cpu" in line
    assert not (tmp_path / "out").exists()


def test_an_out_that_is_a_file_or_holds_foreign_work_is_refused(tmp_path):
    afile = tmp_path / "report"
    afile.write_text("mine")
    assert "is a file: give a directory" in one_error_line(gpu_check("--device", "cpu", "--out", str(afile)))
    foreign = tmp_path / "foreign"
    (foreign / "work").mkdir(parents=True)
    (foreign / "work" / "thesis.tex").write_text("not the check's")
    line = one_error_line(gpu_check("--device", "cpu", "--out", str(foreign), "--budget=correctness=1"))
    assert "is not a gpu-check's work directory: move it away" in line
    assert (foreign / "work" / "thesis.tex").read_text() == "not the check's"
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "work").symlink_to(foreign / "work")
    assert "is not a gpu-check's work directory" in one_error_line(
        gpu_check("--device", "cpu", "--out", str(linked), "--budget=correctness=1"))
    assert (foreign / "work" / "thesis.tex").exists()


def test_a_second_check_into_the_same_directory_is_refused_while_one_runs(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".gpu-check.lock", "a+") as lock:  # what a running check holds
        fcntl.flock(lock, fcntl.LOCK_EX)
        line = one_error_line(gpu_check("--device", "cpu", "--out", str(out)))
    assert f"another slipway gpu-check writes to {out}" in line and not (out / "report.json").exists()


# ---- the report, as a GPU node's would read ------------------------------------------------


def test_a_gpu_nodes_report_renders_its_tables_and_targets():
    """report.md from a report tree of the shape a GPU node's check writes (node facts as
    trainer.gpucheck gives them): values are escaped for Markdown tables, targets judged."""
    report = {"started": "2026-11-27T10:00:00+00:00", "verdict": "passed", "device": "cuda", "devices": 2,
              "seconds": 412.0, "budgets": {"node": 45.0, "speed": 240.0}, "parts": [
                  {"name": "node", "status": "ok", "seconds": 9.0, "budget_s": 45.0, "skipped": [],
                   "checks": [{"what": "GPUs", "ok": True, "detail": "2 x NVIDIA H100 80GB HBM3"}],
                   "results": {"host": "nid|001", "gpus": [
                       {"index": i, "name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "memory_gib": 79.1,
                        "sms": 132, "pci": f"0000:{i + 4:02x}:00.0", "numa_node": i} for i in range(2)],
                       "driver": "580.65.06", "torch_cuda": "13.0", "torch": "2.13.0+cu130", "nccl": "2.27.7",
                       "torch_archs": ["sm_90", "sm_100"], "flash_attn": None,
                       "python": "3.12.3", "machine": "x86_64", "cpus": 64, "affinity": "0-63",
                       "numa": {"0": "0-31", "1": "32-63"}, "numactl": None, "environment": {"A": "b"}}},
                  {"name": "speed", "status": "ok", "seconds": 200.0, "budget_s": 240.0, "skipped": [], "checks": [],
                   "results": {"rows": [
                       {"case": "ours, eager", "tokens_per_s": 400e3, "tokens_per_s_per_device": 400e3,
                        "tflops_per_device": 405.0, "mfu": 0.41, "peak_memory_gib": 20.0, "peak_reserved_gib": 22.0,
                        "vs_bare": 1.01, "flops_per_token": 1012e6,
                        "device_name": "NVIDIA H100 80GB HBM3", "torch": "2.13.0+cu130"},
                       {"case": "ours, compiled", "tokens_per_s": 350e3, "tokens_per_s_per_device": 350e3,
                        "tflops_per_device": 354.0, "mfu": 0.36, "peak_memory_gib": 20.0, "vs_bare": None,
                        "flops_per_token": 1012e6, "device_name": "NVIDIA H100 80GB HBM3", "torch": "2.13.0+cu130"},
                       {"case": "bare, compiled", "tokens_per_s": 351e3, "tokens_per_s_per_device": 351e3,
                        "tflops_per_device": 355.0, "mfu": 0.359, "peak_memory_gib": 21.0, "vs_bare": 1.0,
                        "flops_per_token": 1012e6, "device_name": "NVIDIA H100 80GB HBM3", "torch": "2.13.0+cu130"}]}}]}
    md = render_markdown(report)
    assert md.startswith("# slipway gpu-check: nid\\|001, 2026-11-27T10:00:00+00:00\n")
    assert "| 1 | NVIDIA H100 80GB HBM3 | 9.0 | 79.1 | 132 | 0000:05:00.0 | 1 |" in md
    assert "| ours, eager | 400,000 | 400,000 | 405.000 | 41.0 | 20.00 (22.00) | 1.010 |" in md
    # A miss says the bare loop's MFU beside it: the trainer's overhead, or a model too small for the GPU
    assert "- ours, eager: MFU 41.0% (met)\n- ours, compiled: MFU 36.0% (not met; the bare loop: 35.9%)\n" in md


def test_a_speed_case_refuses_a_run_directory_that_holds_anything(tmp_path, capsys):
    """A speed case's run removes its own checkpoints afterwards: a directory holding a run's files
    (it would resume that run, mix its metrics and lose its saves) is refused, and left as it was."""
    from trainer import speed

    saved = tmp_path / "run" / "checkpoints" / "step-000003" / "COMPLETE"
    saved.parent.mkdir(parents=True)
    saved.write_text("{}")
    assert speed.main(["ours", "--device", "cpu", "--preset", "custom", "--hidden", "64", "--layers", "2", "--heads",
                       "2", "--vocab", "512", "--seq-len", "32", "--steps", "3", "--run-dir", str(saved.parents[2])]) == 2
    assert capsys.readouterr().err == (f"speed ours: not run: --run-dir: {saved.parents[2]} is not empty: give a new "
                                       "directory for the case's run\n")
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("*")] == [
        Path("run"), Path("run/checkpoints"), Path("run/checkpoints/step-000003"), saved.relative_to(tmp_path)]


# ---- the wheels it needs, carried to a node without network --------------------------------


def test_the_bundle_is_for_the_nodes_python_and_glibc_and_leaves_out_what_it_has(tmp_path):
    from common.errors import ConfigError
    from jobs.gpucheck.wheels import node_has, platform_tags

    tags = platform_tags("manylinux_2_28_aarch64")
    assert tags[0] == "manylinux_2_28_aarch64" and tags[-2:] == ["manylinux_2_17_aarch64", "manylinux2014_aarch64"]
    assert "manylinux1_x86_64" in platform_tags("manylinux_2_17_x86_64")
    for bad in ("linux_x86_64", "manylinux_2_28_ppc64le", "macosx_14_0_arm64", "manylinux_2_28_x86_64; rm -rf /"):
        with pytest.raises(ConfigError, match="--platform: "):
            platform_tags(bad)
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("NumPy==1.26.4\npyarrow==19.0.0+cu\n-e git+https://example.org/x#egg=x\nflash_attn==2.8.3\n"
                      "# a comment\nbroken ==\ntorch==2.10.0a0+b4e4ee81d3.nv25.12\n")
    assert node_has(freeze) == {"torch": "2.10.0a0", "numpy": "1.26.4", "pyarrow": "19.0.0", "flash-attn": "2.8.3"}
    with pytest.raises(ConfigError, match="--have: "):
        node_has(tmp_path / "missing.txt")


def test_make_gpu_check_given_a_folder_without_a_bundle_says_so_and_makes_no_venv(tmp_path):
    venv = tmp_path / "check venv"
    for wheels in (tmp_path / "missing", tmp_path):  # none there, and a folder of something else
        proc = subprocess.run(["make", "--no-print-directory", "gpu-check", f"WHEELS={wheels}", f"GPU_CHECK_VENV={venv}"],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert proc.returncode == 2 and proc.stdout == "", (proc.stdout, proc.stderr)
        assert proc.stderr.splitlines()[0] == (f"make gpu-check: WHEELS={wheels}: no bundle there (from make "
                                               "gpu-check-wheels on a login node)"), proc.stderr
        assert not venv.exists()


@pytest.mark.slow
def test_the_bundle_installs_with_no_index_beside_an_existing_torch_and_the_check_runs_from_it(tmp_path, monkeypatch):
    """`make gpu-check-wheels` for this Python, within 60 MiB; then a fresh venv that sees only a
    torch already installed (as a node's Python does) installs it with no index, and
    `slipway gpu-check` runs from that install. Needs an index here (a login node's)."""
    import jobs.gpucheck.wheels as wheels
    from common.errors import ConfigError

    bundle = tmp_path / "wheels"
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    try:
        size = wheels.gather(bundle, python, "manylinux_2_28_x86_64", say=lambda text: None)
    except ConfigError as exc:
        if "resolving failed" in str(exc) or "downloading failed" in str(exc):
            pytest.skip(f"no package index reachable here: {exc}")
        raise
    assert 0 < size <= wheels.MAX_BYTES and size == sum(p.stat().st_size for p in bundle.glob("*.whl"))
    names = sorted(p.name.split("-")[0].lower() for p in bundle.glob("*.whl"))
    assert "slipway" in names and "numpy" in names and "tokenizers" in names
    assert not [n for n in names if n in ("torch", "triton", "datasets", "pyarrow") or n.startswith("nvidia")]
    assert (bundle / "requirements.txt").read_text().splitlines()[1:] == [
        "slipway==0.1.0", "tokenizers>=0.19", "safetensors>=0.4", "numpy>=1.26"]
    # Past the limit: refused in one line, nothing left behind.
    monkeypatch.setattr(wheels, "MAX_BYTES", 2**20)
    with pytest.raises(ConfigError, match=r"MiB of wheels, over the 1 MiB this bundle may take \(largest, MiB: numpy"):
        wheels.gather(tmp_path / "small", python, "manylinux_2_28_x86_64", say=lambda text: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wheels"]
    # A node: its python3 is a venv (as a cluster's often is) that sees torch, and what torch needs,
    # through its own site-packages; `make gpu-check WHEELS=` builds the check's venv over it.
    node = tmp_path / "node"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(node)], check=True)
    node_site = next((node / "lib").glob("python3.*/site-packages"))
    (node_site / "node_torch.pth").write_text(str(torch_only_site(tmp_path / "node site")) + "\n")
    # ... and an older slipway of the same version (a checkout's `pip install .`), which pip would
    # take for the bundle's: the check must run the bundle's code all the same.
    (node_site / "jobs").mkdir()
    (node_site / "jobs" / "__init__.py").write_text("raise ImportError('the node's older slipway')\n")
    (node_site / "slipway-0.1.0.dist-info").mkdir()
    (node_site / "slipway-0.1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: slipway\n"
                                                                     "Version: 0.1.0\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INPUT="1")  # no index, no find-links but the bundle's
    venv, out = tmp_path / "check venv", tmp_path / "report"
    proc = subprocess.run(["make", "--no-print-directory", "gpu-check", f"WHEELS={bundle}", f"OUT={out}",
                           f"PYTHON={node / 'bin' / 'python'}", f"GPU_CHECK_VENV={venv}",
                           "ARGS=--device cpu --budget allreduce=1 --budget speed=1"],
                          capture_output=True, text=True, env={**env, "COLUMNS": "200"}, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    site = next((venv / "lib").glob("python3.*/site-packages"))
    assert not (site / "torch").exists() and (site / "jobs").is_dir()  # the node's torch stays the one
    report = json.loads((out / "report.json").read_text())
    assert [p["status"] for p in report["parts"]] == ["ok", "ok", "ok", "skipped", "skipped"], report["parts"]
    assert all(c["ok"] for p in report["parts"] for c in p["checks"])  # the trainer and slipway local, from wheels


def torch_only_site(root: Path) -> Path:
    """A directory holding (as links) torch and what it requires, from this environment: what a
    node's Python has installed before slipway comes."""
    import importlib.metadata as md
    import re

    root.mkdir()
    todo, seen = ["torch"], set()
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # a requirement for another platform
        for entry in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}:
            target = Path(dist.locate_file(entry))
            if target.exists() and not (root / entry).exists():
                (root / entry).symlink_to(target)
        for req in dist.requires or []:
            if "extra ==" not in req:
                todo.append(re.match(r"[A-Za-z0-9._-]+", req)[0])
    return root


def test_the_report_never_holds_a_secret_the_node_showed(tmp_path):
    """What the node says goes into the report (its environment, errors): masked by the one
    policy, in both files, and report.json still parses."""
    token = "hf_" + "Zq8" * 12
    check = Check(tmp_path, {"node": 45.0}, console=None)
    part = check.part("node")
    part.results = {"environment": {"HF_HOME": "/scratch/hf", "EXTRA": f"HF_TOKEN={token}"}}
    part.check("probe", False, f"exit 1: OSError: cannot reach https://user:{token}@example.org")
    check.finish(part, 0.0)
    for name in ("report.json", "report.md"):
        assert token not in (tmp_path / name).read_text()
    assert json.loads((tmp_path / "report.json").read_text())["parts"][0]["results"]["environment"]["HF_HOME"] == \
        "/scratch/hf"
