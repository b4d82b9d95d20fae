"""Warm ranks (trainer/warm.py), the warm process and each rank's client, as the batch script runs
them, without Slurm: a code snapshot of its own whose "heavy" imports are stand-ins (a fake `torch`
among them, so a change to it can be made), on an abstract socket of the test's own. The whole dev
loop on the real Slurm, real torch, is tests/test_dev_loop.py's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

WARM = Path(__file__).resolve().parents[1] / "trainer" / "warm.py"
PY = sys.executable


def _load_warm():
    import importlib.util

    spec = importlib.util.spec_from_file_location("slipway_warm_under_test", WARM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def code(tmp_path: Path) -> Path:
    """A code snapshot: trainer/ and common/ importing a stand-in torch and each other."""
    root = tmp_path / "code"
    (root / "trainer").mkdir(parents=True)
    (root / "common").mkdir()
    (root / "trainer" / "__init__.py").write_text("")
    (root / "common" / "__init__.py").write_text("")
    (root / "trainer" / "train.py").write_text(
        "import json\nimport torch\nfrom common import thing\ntry:\n    import heavy_missing\nexcept ImportError:\n"
        "    pass\nif True:\n    from torch import cuda\n\ndef later():\n    import not_at_module_level\n")
    (root / "common" / "thing.py").write_text("from . import x\nimport csv\n")
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("from torch import cuda\n")
    (site / "torch" / "version.py").write_text("__version__ = '0'\n")
    (site / "torch" / "cuda.py").write_text("def is_initialized():\n    return False\n")
    return root


def test_the_warm_process_imports_what_the_code_imports_at_module_level_never_the_code(code):
    warm = _load_warm()
    assert warm.module_imports(code) == ["json", "torch", "heavy_missing", "csv"]


class Server:
    def __init__(self, code: Path, tmp: Path):
        self.name = f"slipway-warm-test-{uuid.uuid4().hex[:12]}"
        self.log = tmp / "warm.out"
        env = {**os.environ, "PYTHONPATH": f"{code}:{tmp / 'site'}", "SLIPWAY_WARM_ID": "k1", "PYTHONSAFEPATH": "1"}
        self.proc = subprocess.Popen([PY, str(WARM), "serve", self.name, "--code", str(code)], env=env,
                                     stdout=self.log.open("w"), stderr=subprocess.STDOUT, cwd=tmp)
        deadline = time.monotonic() + 120
        while "ready" not in self.log.read_text():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)

    def client(self, argv: list[str], env: dict | None = None, **kwargs) -> subprocess.Popen:
        return subprocess.Popen([PY, "-S", str(WARM), "rank", self.name, "--", *argv],
                                env={**os.environ, "SLIPWAY_WARM_ID": "k1", **(env or {})}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, **kwargs)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)


@pytest.fixture
def server(code: Path, tmp_path: Path):
    s = Server(code, tmp_path)
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait()


RANK = """import json, os, sys
import torch
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "cwd": os.getcwd(),
                  "rank": os.environ.get("RANK"), "torch": torch.__file__, "sid": os.getsid(0),
                  "code": [m for m in sys.modules if m.split(".")[0] in ("trainer", "common")],
                  "path0": sys.path[0], "umask": oct(os.umask(0))}), flush=True)
sys.exit(int(os.environ.get("EXIT", "0")))
"""


def test_a_rank_starts_from_the_warm_process_as_it_would_start_cold(server, tmp_path):
    script = tmp_path / "work" / "rank.py"
    script.parent.mkdir()
    script.write_text(RANK)
    procs = [server.client([PY, str(script), "a b", "$(x)"], {"RANK": str(r), "EXIT": str(3 * r),
                                                               "PYTHONPATH": str(tmp_path / "site"), "PYTHONSAFEPATH": "1"},
                           cwd=script.parent, umask=0o027) for r in range(2)]
    seen = []
    for r, proc in enumerate(procs):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 3 * r and "cold" not in err, (out, err)
        seen.append(json.loads(out))
    for r, got in enumerate(seen):
        assert got["ppid"] == server.proc.pid and got["sid"] == got["pid"]  # the warm process's child, in its own session
        assert got["argv"] == [str(script), "a b", "$(x)"] and got["rank"] == str(r)
        assert got["cwd"] == str(script.parent) and got["umask"] == "0o27"
        assert got["torch"].startswith(str(tmp_path / "site")) and got["code"] == []
        assert got["path0"] == str(tmp_path / "site")  # the rank's own PYTHONPATH first (PYTHONSAFEPATH)


def test_signals_reach_the_rank_and_a_rank_never_outlives_its_client(server, tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import os, sys, time\nprint(os.getpid(), flush=True)\ntime.sleep(120)\n")
    proc = server.client([PY, str(script)])
    pid = int(proc.stdout.readline())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert not _alive(pid)
    proc = server.client([PY, str(script)])
    pid = int(proc.stdout.readline())
    proc.kill()  # Slurm's SIGKILL at a step's end: the client cannot pass it on, its death says it
    proc.wait()
    deadline = time.monotonic() + 30
    while _alive(pid):
        assert time.monotonic() < deadline, f"rank {pid} outlived its client"
        time.sleep(0.05)
    # The warm process serves on.
    again = server.client([PY, "-c", "print(1)"])
    assert again.communicate(timeout=30)[1].startswith("slipway-warm ") and again.returncode == 0  # -c: cold


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_without_a_warm_process_the_rank_starts_cold(tmp_path):
    script = tmp_path / "r.py"
    script.write_text("import os, sys\nprint(os.getppid())\nsys.exit(5)\n")
    proc = subprocess.Popen([PY, "-S", str(WARM), "rank", f"slipway-warm-none-{uuid.uuid4().hex}", "--", PY,
                             str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 5 and "starts cold: no warm process on this node" in err
    assert int(out) != proc.pid  # the client exec'd the rank: its parent is ours


def test_torch_changed_under_the_warm_process_starts_cold_and_ends_it(server, tmp_path):
    init = tmp_path / "site" / "torch" / "version.py"
    init.write_text("__version__ = '1'  # reinstalled\n")
    proc = server.client([PY, str(init)])
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "starts cold: torch changed under the warm process" in err
    assert server.proc.wait(timeout=30) == 0 and "stopped" in server.log.read_text()


def test_another_users_client_is_refused(server, tmp_path):
    """A warm process forks for its own user alone (the peer's credentials on its socket)."""
    if os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs root (to run a client as another user) and /usr/bin/python3")
    import tempfile

    shared = Path(tempfile.mkdtemp(prefix="slipway-warm-test-"))
    try:
        shared.chmod(0o755)
        script = shared / "r.py"
        script.write_text("import os\nprint(os.getppid())\n")
        script.chmod(0o644)
        proc = subprocess.Popen(["/usr/bin/python3", "-S", str(WARM), "rank", server.name, "--", "/usr/bin/python3",
                                 str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: os.setuid(65534), cwd=shared)
        out, err = proc.communicate(timeout=60)
    finally:
        import shutil

        shutil.rmtree(shared)
    assert "starts cold" in err and int(out) != server.proc.pid, (out, err)


def test_sigterm_drains_the_warm_process(server, tmp_path):
    script = tmp_path / "slow.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(1)\n")
    proc = server.client([PY, str(script)])
    assert proc.stdout.readline() == "up\n"
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert server.proc.poll() is None  # its rank runs on
    late = server.client([PY, str(script)])  # the name is free: a new warm process could take it
    assert "starts cold" in late.communicate(timeout=30)[1]
    assert proc.wait(timeout=30) == 0 and server.proc.wait(timeout=30) == 0


# ------------------------------------------------------------------ the batch script's part


def _script(project: Path, *overrides: str) -> tuple[str, str]:
    """(job.sbatch as `slipway run` would write it, its warm key)."""
    import re

    from jobs import runs
    from jobs.config import load_config

    cfg = load_config("tiny_cpu", ["slurm.nodes=2", "parallel.dp=4", *overrides])
    sealed = runs.seal(cfg, project, dry_run=True)
    text = sealed.files[sealed.paths.job_script]
    key = re.search(r"^export SLIPWAY_WARM_ID=([0-9a-f]{16})$", text, re.M)
    return text, key.group(1) if key else ""


def test_slipway_run_starts_its_ranks_and_node_step_through_the_warm_processes(project):
    text, key = _script(project)
    assert key
    lines = text.splitlines()
    # Under `slipway run` only (SLIPWAY_IN_ALLOCATION): a batch job runs one launch and keeps none.
    i = lines.index('if [ -n "${SLIPWAY_IN_ALLOCATION:-}" ]; then')
    assert lines[i + 2].startswith("  WARM_CLIENT=(") and '"$CODE_DIR"/trainer/warm.py rank "$WARM_NAME" --)' in lines[i + 2]
    assert lines.index("warm_up") == lines.index("verify_nodes") + 1
    launch = next(line for line in lines if "slipway-rank" in line)
    assert launch.index('"${WARM_CLIENT[@]}"') < launch.index("-m trainer --config")
    node = next(line for line in lines if "trainer.preflight node" in line)
    assert node.lstrip().startswith('"${WARM_CLIENT[@]}"')
    start = text[text.index("warm_start() {"):]
    # The warm step: not of this run (a launcher sweeps its processes by these), one task per node.
    assert "env -u SLIPWAY_RUN_DIR -u SLIPWAY_JOB_TAG -u SLIPWAY_CODE -u SLIPWAY_EVENT_JOB setsid srun --overlap" in start
    assert '"--nodes=$2" "--ntasks=$2"' in start and '"--job-name=slipway-warm-$SLIPWAY_WARM_ID"' in start


def test_the_warm_key_is_what_the_warm_processes_started_with(project, tmp_path):
    """The same for another run name or a code change (each rank imports the run's code), another
    for a setting the warm process took at its start; no warm processes where they cannot serve."""
    import shutil

    for package in ("common", "trainer"):  # the project's own checkout of the code
        shutil.copytree(WARM.parents[1] / package, project / package, ignore=shutil.ignore_patterns("__pycache__"))
    _, key = _script(project)
    with open(project / "trainer" / "model.py", "a") as f:
        f.write("# a one-line change\n")
    assert _script(project)[1] == key
    assert _script(project, "run.name=other", "train.steps=7")[1] == key
    assert _script(project, "launch.env.OMP_PROC_BIND=close")[1] not in ("", key)
    assert _script(project, "launch.python=/usr/bin/python3")[1] not in ("", key)
    image = tmp_path / "a.sqsh"
    image.write_bytes(b"squashfs one")
    pyxis = ["container.runtime=pyxis", f"container.image={image}"]
    _, one = _script(project, *pyxis)
    image.write_bytes(b"squashfs two, rebuilt")
    _, two = _script(project, *pyxis)
    assert one and two and len({key, one, two}) == 3
    for cold in ("launch.warm=false", "launch.launcher=torchrun", "code.snapshot=false", "container.runtime=edf"):
        text, key = _script(project, cold)
        assert not key and "WARM_CLIENT" not in text and "warm_up" not in text, cold
