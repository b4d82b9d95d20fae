"""Warm ranks (trainer/warm.py), the warm process and each rank's client, as the batch script runs
them, without Slurm: a code snapshot of its own whose "heavy" imports are stand-ins (a fake `torch`
among them, so a change to it can be made), on a socket folder of the test's own; and the same rank
run warm and cold with the real torch, numpy and HF libraries, compared. The whole dev loop on the
real Slurm is tests/test_dev_loop.py's."""

from __future__ import annotations

import hmac
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from other_user import teammate  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[1]
WARM = ROOT / "trainer" / "warm.py"
CLIENT = ROOT / "trainer" / "warm_rank.py"
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
    # An import that sets a variable, as threadpoolctl does: a warm rank's environment has it too.
    (site / "torch" / "__init__.py").write_text("import os\nfrom torch import cuda\nos.environ.setdefault('SET_BY_IMPORT', '1')\n")
    (site / "torch" / "version.py").write_text("__version__ = '0'\n")
    (site / "torch" / "cuda.py").write_text("def is_initialized():\n    return False\n")
    return root


def test_the_warm_process_imports_what_the_code_imports_at_module_level_never_the_code(code):
    warm = _load_warm()
    assert warm.module_imports(code) == ["json", "torch", "heavy_missing", "csv"]


class Server:
    """A warm process of allocation `job` on node n1 (a folder of the test's own for its socket)."""

    def __init__(self, code: Path, tmp: Path, job: str = "41", folder: Path | None = None, key: str = "k1", **env: str):
        self.folder = folder or Path(tempfile.mkdtemp(prefix="slipway-warm-", dir="/tmp")) / "w"
        self.prefix, self.log = f"{self.folder}/{job}-{key}", tmp / f"warm-{job}-{key}.out"
        self.env = {**os.environ, "PYTHONPATH": f"{code}:{tmp / 'site'}", "SLIPWAY_WARM_ID": key, "PYTHONSAFEPATH": "1",
                    "SLURM_JOB_ID": job, "SLURMD_NODENAME": "n1", **env}
        self.proc = subprocess.Popen([PY, str(WARM), "serve", self.prefix, "--code", str(code)], env=self.env,
                                     stdout=self.log.open("w"), stderr=subprocess.STDOUT, cwd=tmp)
        deadline = time.monotonic() + 180
        while not any(w in self.log.read_text() for w in ("ready", "cannot serve")):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)

    def client(self, argv: list[str], env: dict | None = None, **kwargs) -> subprocess.Popen:
        return subprocess.Popen([PY, "-S", str(CLIENT), "rank", self.prefix, "--", *argv], env={**self.env, **(env or {})},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)

    def done(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder.parent, ignore_errors=True)


@pytest.fixture
def server(code: Path, tmp_path: Path):
    s = Server(code, tmp_path)
    yield s
    s.done()


RANK = """import json, os, sys
import torch
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "cwd": os.getcwd(),
                  "rank": os.environ.get("RANK"), "torch": torch.__file__, "sid": os.getsid(0),
                  "code": [m for m in sys.modules if m.split(".")[0] in ("trainer", "common")],
                  "path0": sys.path[0], "umask": oct(os.umask(0)), "set": os.environ.get("SET_BY_IMPORT")}), flush=True)
sys.exit(3 * int(os.environ.get("RANK", "0")))
"""


def test_a_rank_starts_from_the_warm_process_as_it_would_start_cold(server, tmp_path):
    script = tmp_path / "work" / "rank.py"
    script.parent.mkdir()
    script.write_text(RANK)
    procs = [server.client([PY, str(script), "a b", "$(x)"], {"RANK": str(r)},
                           cwd=script.parent, umask=0o027) for r in range(2)]
    seen = []
    for r, proc in enumerate(procs):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 3 * r and f"rank {r} started warm" in err, (out, err)
        seen.append(json.loads(out))
    for r, got in enumerate(seen):
        assert got["ppid"] == server.proc.pid and got["sid"] == got["pid"]  # the warm process's child, in its own session
        assert got["argv"] == [str(script), "a b", "$(x)"] and got["rank"] == str(r)
        assert got["cwd"] == str(script.parent) and got["umask"] == "0o27" and got["set"] == "1"
        assert got["torch"].startswith(str(tmp_path / "site")) and got["code"] == []
        assert got["path0"] == str(server.env["PYTHONPATH"].split(":")[0])  # the rank's PYTHONPATH first (PYTHONSAFEPATH)


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
    again = server.client([PY, "-c", "print(1)"])  # the warm process serves on
    assert "starts cold: its command is not" in again.communicate(timeout=30)[1] and again.returncode == 0  # -c: cold


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _cold(server: Server, env: dict | None = None, **kwargs) -> str:
    """What a client says when its rank (a script printing its parent) starts cold; it did."""
    script = Path(tempfile.mkdtemp(dir=server.log.parent)) / "r.py"
    script.write_text("import os\nprint(os.getppid())\n")
    proc = server.client([PY, str(script)], env, **kwargs)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and int(out) != server.proc.pid and "starts cold: " in err, (out, err)
    return err.split("starts cold: ", 1)[1].strip()


def test_without_a_warm_process_the_rank_starts_cold(server):
    assert _cold(server, {"SLURMD_NODENAME": "n2"}) == "no warm process on this node"


def test_a_changed_module_or_environment_starts_cold_and_a_changed_module_retires_the_warm_process(server, tmp_path):
    """Named, never shown: a variable's value may be a secret. What differs per launch, step or
    rank (Slurm's, slipway's, the rank variables) starts warm."""
    assert _cold(server, {"HF_HUB_OFFLINE": "1", "WANDB_API_KEY": "s3cr3t"}) == \
        "its environment differs from the warm process's in HF_HUB_OFFLINE, WANDB_API_KEY"
    proc = server.client([PY, "-c", "0"], {"RANK": "3", "SLURM_STEP_ID": "9", "SLIPWAY_RUN_DIR": "/r", "MASTER_PORT": "1"})
    assert "its command is not" in proc.communicate(timeout=60)[1]  # the environment passed: -c is what is refused
    shadow = tmp_path / "shadow" / "torch"
    shadow.parent.mkdir()
    env = {"PYTHONPATH": f"{shadow.parent}:{server.env['PYTHONPATH']}"}
    rank = tmp_path / "ppid.py"  # a rank that imports what the warm process does not hold: it learns it
    rank.write_text("import colorsys, os, sys\nprint(os.getppid(), flush=True)\nsys.stdin.read()\n")
    proc = server.client([PY, str(rank)], env, stdin=subprocess.PIPE)  # warm: what this sys.path finds is known
    assert proc.stdout.readline().strip() == str(server.proc.pid)
    shadow.mkdir()
    (shadow / "__init__.py").write_text("")  # then, in the same launch, a folder on it changes: found again
    assert _cold(server, env) == \
        f"its sys.path finds torch at {shadow / '__init__.py'}, not at {tmp_path / 'site' / 'torch' / '__init__.py'}"
    held = tmp_path / "site" / "torch" / "cuda.py"
    held.write_text(held.read_text() + "# upgraded\n")  # while the rank runs; after its end the warm process
    proc.communicate(timeout=60)  # imports what it learned, and the file it holds stays the one it imported
    deadline = time.monotonic() + 30
    while " learned " not in server.log.read_text():
        assert time.monotonic() < deadline, server.log.read_text()
        time.sleep(0.05)
    assert _cold(server) == f"{held} changed on disk since the warm process imported it; it stops"
    assert server.proc.wait(timeout=30) == 0 and "stopped" in server.log.read_text()


def test_a_rank_whose_cpus_size_the_thread_pools_otherwise_starts_cold(code, tmp_path):
    """OpenBLAS sizes its pool at import by OMP_NUM_THREADS, at most the CPUs it runs on: a rank on
    fewer CPUs than the warm process starts cold, unless OMP_NUM_THREADS leaves both alike."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU here: no fewer to start a rank on")
    one = {"preexec_fn": lambda: os.sched_setaffinity(0, cpus[:1])}
    unset, pinned = Server(code, tmp_path, job="51"), Server(code, tmp_path, job="52", OMP_NUM_THREADS="1")
    try:
        assert _cold(unset, **one) == "its 1 CPUs size the libraries' thread pools otherwise than the warm process's"
        proc = pinned.client([PY, "-c", "0"], **one)
        assert "its command is not" in proc.communicate(timeout=60)[1]  # past the CPUs: only -c is refused
    finally:
        unset.done()
        pinned.done()


def test_sigterm_drains_the_warm_process_and_frees_its_name_at_once(server, code, tmp_path):
    script = tmp_path / "slow.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(1)\n")
    proc = server.client([PY, str(script)])
    assert proc.stdout.readline() == "up\n"
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert server.proc.poll() is None  # its rank runs on
    assert _cold(server) == "no warm process on this node"
    (tmp_path / "next").mkdir()
    successor = Server(code, tmp_path / "next", folder=server.folder)  # the name is free: a new warm process takes it
    try:
        assert "already served" not in successor.log.read_text() and successor.proc.poll() is None
        again = successor.client([PY, str(script)])
        out, err = again.communicate(timeout=60)
        assert "started warm" in err, (out, err)
        assert proc.wait(timeout=30) == 0 and server.proc.wait(timeout=30) == 0
        assert "stopped" in server.log.read_text()
        assert sorted(p.name for p in server.folder.iterdir()) == ["41-k1-n1.lock", "41-k1-n1.sock", "41.secret"]
    finally:
        successor.done()


def _node(server: Server, argv: list[str], env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """`warm_rank.py node`: slipway's node check asked from the host, as verify_lib.sh's node_check does."""
    return subprocess.run([PY, "-S", str(CLIENT), "node", server.prefix, "--", *argv], env={**server.env, **(env or {})},
                          capture_output=True, text=True, timeout=60, **kwargs)


def test_the_node_check_from_the_host_runs_as_the_warm_process_is_with_the_runs_code(server, tmp_path):
    """The host's environment is not the container's: the check takes the warm process's own
    environment, directory and CPUs, and only the run's code and variables from the host; where
    the warm process does not take it, nothing runs on the host (the node step runs it instead)."""
    run_code = tmp_path / "run-code"
    run_code.mkdir()
    (run_code / "check.py").write_text("import json, os, sys\nprint(json.dumps({'ppid': os.getppid(), 'cwd': os.getcwd(), "
                                       "'env': dict(os.environ), 'path': sys.path[0]}))\nsys.exit(4)\n")
    host = tmp_path / "host"
    host.mkdir()
    path = f"{run_code}:{server.env['PYTHONPATH']}"
    done = _node(server, [PY, "-m", "check"], {"HF_HUB_OFFLINE": "1", "PYTHONPATH": path, "SLIPWAY_RUN_DIR": "/r"},
                 cwd=host, preexec_fn=lambda: os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1]))
    got = json.loads(done.stdout)
    assert done.returncode == 4 and "the node step started warm (pid " in done.stderr, done
    assert got["ppid"] == server.proc.pid and got["cwd"] == str(tmp_path) and got["path"] == str(run_code)
    assert "HF_HUB_OFFLINE" not in got["env"] and got["env"]["SLIPWAY_RUN_DIR"] == "/r"
    marker = tmp_path / "ran-on-the-host"
    on_host = [PY, "-c", f"open({str(marker)!r}, 'w')"]
    for env, why in (({"SLURMD_NODENAME": "n2"}, "no warm process on this node"),
                     ({"SLURM_JOB_ID": "43"}, "no secret of this allocation's")):
        done = _node(server, on_host, env)
        assert done.returncode == 3 and f"the node step runs in a step of its own: {why}" in done.stderr, done
    held = tmp_path / "site" / "torch" / "cuda.py"
    held.write_text(held.read_text() + "# upgraded\n")
    done = _node(server, [PY, "-m", "check"], {"PYTHONPATH": path})
    assert done.returncode == 3 and f"{held} changed on disk since the warm process imported it" in done.stderr, done
    assert not marker.exists() and server.proc.wait(timeout=30) == 0


# ------------------------------------------------------------------ a hostile channel


def _proven(server: Server, secret: bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(f"{server.prefix}-n1.sock")
    challenge = json.loads(sock.recv(4096))["challenge"]
    sock.send(json.dumps({"answer": hmac.new(secret, challenge.encode(), "sha256").hexdigest(),
                          "challenge": "c"}).encode())
    assert "answer" in json.loads(sock.recv(4096))
    return sock


def test_a_malformed_request_ends_its_connection_only(server, tmp_path):
    secret = (server.folder / "41.secret").read_bytes()
    for payload in (b"garbage", b"[1]", b'{"answer": "forged"}', b"\xff" * 64, b"{}" * 60000):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(f"{server.prefix}-n1.sock")
        assert "challenge" in json.loads(sock.recv(4096))
        sock.send(payload)
        assert sock.recv(4096) == b""  # closed on it, nothing forked
        sock.close()
    request = {"argv": [PY, "x.py"], "executable": os.path.realpath(PY), "env": {}, "cwd": "/", "cpus": [0], "umask": 18}
    for bad in ({**request, "env": {"A": 1}}, {**request, "cpus": "all"}, {**request, "argv": [PY]}, request):
        sock = _proven(server, secret)
        sock.send(json.dumps(bad).encode())  # the last: well formed, but without the three standard streams
        assert sock.recv(4096) == b""
        sock.close()
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    idle.connect(f"{server.prefix}-n1.sock")  # connects and says nothing: closed once its time to prove is up
    idle.settimeout(60)
    assert "challenge" in json.loads(idle.recv(4096)) and idle.recv(4096) == b""
    script = tmp_path / "ok.py"
    script.write_text("print('ok')\n")
    proc = server.client([PY, str(script)])
    assert proc.communicate(timeout=60)[0] == "ok\n" and server.proc.poll() is None
    assert server.log.read_text().count("a connection ended: ") == 9


HOSTILE_RANK = """import os, socket
fds = {int(f): os.readlink(f"/proc/self/fd/{f}") for f in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{f}")}
assert not [t for fd, t in fds.items() if fd > 2 and not t.startswith("socket:")], fds  # nothing else of the warm process's
for fd in [fd for fd, t in fds.items() if fd > 2]:  # its report channel
    with socket.socket(fileno=os.dup(fd)) as s:
        s.send(b"\\xff not json")
print(len(fds) - 3, flush=True)
"""


STRING_REPORT = HOSTILE_RANK.replace('b"\\xff not json"', 'b\'{"imported": "csvx"}\'')  # a string, not a list


def test_only_a_forked_rank_says_what_it_imported_and_garbage_there_ends_that_channel_only(server, tmp_path):
    """What the next ranks start with comes from the ranks' own report channels, made with each fork:
    a proven client that claims imports is cut off with nothing learned; a rank that writes garbage,
    or a report that is no list, on its channel ends that channel only; a rank's real imports are
    held for the next one."""
    sock = _proven(server, (server.folder / "41.secret").read_bytes())
    sock.send(json.dumps({"imported": ["wave"]}).encode())
    assert sock.recv(4096) == b""
    sock.close()
    for name, text in (("hostile.py", HOSTILE_RANK), ("report_str.py", STRING_REPORT), ("wave_user.py", "import wave\n"),
                       ("held.py", "import sys\nprint('wave' in sys.modules)\n")):
        (tmp_path / name).write_text(text)
        out, err = server.client([PY, str(tmp_path / name)]).communicate(timeout=60)
        assert "started warm" in err, err
        deadline = time.monotonic() + 60
        while name == "wave_user.py" and "learned" not in server.log.read_text():
            assert time.monotonic() < deadline, server.log.read_text()
            time.sleep(0.05)
        assert name != "hostile.py" or out == "1\n", (out, err)
    assert out == "True\n" and server.proc.poll() is None
    assert server.log.read_text().count("a connection ended: ") == 3  # a report that is no list ends its channel too


def test_another_allocations_client_gets_nothing(server, code, tmp_path):
    """Allocation 42's warm process and client hold 42's secret: asked of 41's warm process, each
    side refuses the other's proof, and the rank starts cold."""
    other = Server(code, tmp_path, job="42", folder=server.folder)
    try:
        assert (server.folder / "42.secret").read_bytes() != (server.folder / "41.secret").read_bytes()
        assert _cold(server, {"SLURM_JOB_ID": "42"}) == "the process on the warm socket did not prove this allocation's secret"
        assert "a client without this allocation's secret" in server.log.read_text()
        assert _cold(server, {"SLURM_JOB_ID": "43"}).startswith("no secret of this allocation's")
    finally:
        other.done()


def test_a_warm_process_leaves_nothing_behind_and_sweeps_what_one_killed_outright_left(code, tmp_path):
    """On a node's /dev/shm, allocation after allocation: a warm process that stops removes its files,
    and the allocation's secret with the last of its warm processes there; what one killed outright
    left (SIGKILL at its allocation's end) goes when a later allocation's warm process starts, and
    never anything of an allocation whose warm process lives."""
    killed = Server(code, tmp_path, job="40")
    folder = killed.folder
    live, servers = Server(code, tmp_path, job="41", folder=folder), [killed]
    servers.append(live)
    rank = tmp_path / "r.py"
    rank.write_text("import os\nprint(os.getppid())\n")

    def files() -> list[str]:
        return sorted(p.name for p in folder.iterdir())

    def stop(server: Server) -> None:
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0 and "stopped" in server.log.read_text()

    try:
        killed.proc.kill()
        killed.proc.wait()
        left = ["40-k1-n1.lock", "40-k1-n1.sock", "40.secret"]
        assert files() == [*left, "41-k1-n1.lock", "41-k1-n1.sock", "41.secret"]
        servers += [Server(code, tmp_path, job="42", folder=folder, key=key) for key in ("k1", "k2", "k3")]
        assert files() == ["41-k1-n1.lock", "41-k1-n1.sock", "41.secret", "42-k1-n1.lock", "42-k1-n1.sock",
                           "42-k2-n1.lock", "42-k2-n1.sock", "42-k3-n1.lock", "42-k3-n1.sock", "42.secret"]
        proc = live.client([PY, str(rank)])
        out, err = proc.communicate(timeout=60)
        assert int(out) == live.proc.pid and "started warm" in err, (out, err)  # the live allocation's, untouched
        servers[4].proc.kill()
        servers[4].proc.wait()
        stop(servers[2])
        assert files() == ["41-k1-n1.lock", "41-k1-n1.sock", "41.secret", "42-k2-n1.lock", "42-k2-n1.sock",
                           "42-k3-n1.lock", "42-k3-n1.sock", "42.secret"]
        stop(servers[3])  # 42's last live warm process on the node: all of 42's goes, its killed sibling's too
        stop(live)
        assert files() == []
    finally:
        for server in servers:
            server.done()


def test_another_users_client_and_folder_are_refused(code, tmp_path, teammate):
    """The folder is the user's alone: another user's client cannot reach the socket, and a folder
    another user made under that name (or one open to others) is no warm process's."""
    s = Server(code, tmp_path)
    try:
        script = teammate.shared / "r.py"
        script.write_text("import os\nprint(os.getppid())\n")
        proc = subprocess.run(["setpriv", f"--reuid={teammate.uid}", f"--regid={teammate.gid}", "--clear-groups", "--",
                               teammate.python, "-S", str(CLIENT), "rank", s.prefix, "--", teammate.python, str(script)],
                              capture_output=True, text=True, timeout=60, cwd=teammate.shared,
                              env={"SLURM_JOB_ID": "41", "SLURMD_NODENAME": "n1", "PATH": os.environ["PATH"]})
        assert proc.returncode == 0 and int(proc.stdout) != s.proc.pid and "starts cold" in proc.stderr, proc
    finally:
        s.done()
    squat = Path(tempfile.mkdtemp(prefix="slipway-warm-", dir="/tmp")) / "w"
    squat.mkdir(mode=0o700)
    os.chown(squat, teammate.uid, teammate.gid)
    s = Server(code, tmp_path, folder=squat)
    try:
        assert s.proc.wait(timeout=30) == 0 and "cannot serve: " in s.log.read_text()
        assert "is not a folder of this user's closed to others" in _cold(s)
    finally:
        s.done()


# ------------------------------------------------------------------ warm and cold, side by side


PROBE = """import json, logging, os, random, sys
held = "huggingface_hub" in sys.modules  # the warm process's, learned from a first rank
import numpy, torch
import huggingface_hub.constants as hf
a = numpy.ones((300, 300)); a @ a; torch.ones(300, 300) @ torch.ones(300, 300)
try:
    import threadpoolctl
    pools = sorted((p["internal_api"], p["num_threads"]) for p in threadpoolctl.threadpool_info())
except ImportError:
    pools = None
print(json.dumps({
    "constants": [hf.HF_HUB_OFFLINE, hf.HF_HOME, logging.getLogger("torch._dynamo").level],
    "startup": [list(sys.flags), sys.path, sys.argv, os.getcwd(), dict(os.environ)],
    "modules": {m: getattr(sys.modules[m], "__file__", None) for m in list(sys.modules)},
    "threads": [torch.get_num_threads(), torch.get_num_interop_threads(), len(os.listdir("/proc/self/task")), pools],
    "cpus": sorted(os.sched_getaffinity(0)),
    "draws": [random.random(), float(numpy.random.random()), float(torch.rand(1))], "held": held}))
"""


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("cpus_per_task", [1, 4])
def test_a_warm_rank_sees_what_a_cold_one_sees(tmp_path, cpus_per_task):
    """The same rank, warm and cold, on the real trainer's imports (torch, numpy; the HF libraries
    once learned from a first rank), with the OMP_NUM_THREADS the batch script gives `cpus_per_task`
    (jobs/slurm/script.py): the same environment-derived constants, startup state, module files,
    thread counts and CPUs; fresh random draws in each. Another HF_HUB_OFFLINE starts it cold."""
    code = tmp_path / "code"
    for package in ("trainer", "common"):
        shutil.copytree(ROOT / package, code / package, ignore=shutil.ignore_patterns("__pycache__"))
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    env = {"OMP_NUM_THREADS": str(cpus_per_task), "HF_HOME": str(tmp_path / "hf"), "TORCH_LOGS": "dynamo",
           "PYTHONPATH": str(code), "PYTHONHASHSEED": "7"}
    server = Server(code, tmp_path, **env)
    try:
        assert "every rank starts cold" not in server.log.read_text()
        seen = {}
        for i, (how, extra) in enumerate([("warm", {}), ("cold", {}), ("warm", {}), ("cold", {}),
                                          ("cold", {"HF_HUB_OFFLINE": "1"}), ("warm", {"HF_HUB_OFFLINE": "1"})]):
            argv = [PY, str(probe)] if how == "cold" else [PY, "-S", str(CLIENT), "rank", server.prefix, "--", PY, str(probe)]
            r = subprocess.run(argv, env={**server.env, **extra}, capture_output=True, text=True, timeout=300, cwd=tmp_path)
            assert r.returncode == 0, r.stderr[-3000:]
            assert how == "cold" or ("started warm" in r.stderr) == (not extra), r.stderr[-2000:]
            seen[i] = json.loads(r.stdout)
        assert "learned" in server.log.read_text()  # the HF libraries, from the first rank: held by the third
        assert [s["held"] for s in seen.values()] == [False, False, True, False, False, False]
        assert seen[4]["constants"][0] is True and seen[5]["constants"] == seen[4]["constants"]
        for warm, cold in ((0, 1), (2, 3), (5, 4)):
            for what in ("constants", "startup", "threads", "cpus"):
                assert seen[warm][what] == seen[cold][what], what
            both = set(seen[warm]["modules"]) & set(seen[cold]["modules"])
            assert {m: seen[warm]["modules"][m] for m in both} == {m: seen[cold]["modules"][m] for m in both}
        draws = [tuple(s["draws"]) for s in seen.values()]
        assert len(set(draws)) == len(draws) and all(len(set(column)) == len(draws) for column in zip(*draws))
    finally:
        server.done()


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
    from jobs.config import interpreter

    text, key = _script(project)
    assert key
    lines = text.splitlines()
    # Under `slipway run` only (SLIPWAY_IN_ALLOCATION): a batch job runs one launch and keeps none.
    i = lines.index('if [ -n "${SLIPWAY_IN_ALLOCATION:-}" ]; then')
    assert lines[i + 2].startswith("  WARM_CLIENT=(") and '"$CODE_DIR"/trainer/warm_rank.py rank "$WARM_SOCKET" --)' in lines[i + 2]
    assert lines.index("warm_up") == lines.index("verify_nodes") + 1
    launch = next(line for line in lines if "slipway-rank" in line)
    assert launch.index('"${WARM_CLIENT[@]}"') < launch.index("-m trainer --config")
    check, node = [line for line in lines if "trainer.preflight node" in line]
    # The node check: asked of the warm process with the verification, from the host (no container
    # entered), bounded within the verification's bound; else the node step, through the client.
    # Its client by the interpreter slipway runs under where the node has it, else launch.python (here
    # slipway's own too), or the host's python3 under a container (no srun step enters it for the check).
    mine = interpreter(sys.executable)
    assert check.startswith(f"  WARM_CHECK=(150 {mine} {mine} -S ") and \
        '-S "$CODE_DIR"/trainer/warm_rank.py node "$WARM_SOCKET" -- ' in check and lines.index(check) == i + 3
    assert node.lstrip().startswith('"${WARM_CLIENT[@]}"')
    assert lines[lines.index(node) - 1].startswith("pf_t=$SECONDS; set +e; checked_warm || timeout -k 15 ")
    (project / "a.sqsh").write_bytes(b"squashfs")
    pyxis, _ = _script(project, "container.runtime=pyxis", f"container.image={project / 'a.sqsh'}")
    assert f"  WARM_CHECK=(150 {mine} python3 -S " in pyxis
    start = text[text.index("warm_start() {"):]
    # The warm step: not of this run (a launcher sweeps its processes by these), one task per node.
    assert "env -u SLIPWAY_RUN_DIR -u SLIPWAY_JOB_TAG -u SLIPWAY_CODE -u SLIPWAY_EVENT_JOB setsid srun --overlap" in start
    assert '"--nodes=$2" "--ntasks=$2"' in start and '"--job-name=slipway-warm-$SLIPWAY_WARM_ID"' in start


def test_the_warm_key_is_what_the_warm_processes_started_with(project, tmp_path):
    """The same for another run name or a code change (each rank imports the run's code), another
    for a setting the warm process took at its start; no warm processes where they cannot serve."""
    for package in ("common", "trainer"):  # the project's own checkout of the code
        shutil.copytree(ROOT / package, project / package, ignore=shutil.ignore_patterns("__pycache__"))
    _, key = _script(project)
    with open(project / "trainer" / "model.py", "a") as f:
        f.write("# a one-line change\n")
    assert _script(project)[1] == key
    for own in ("warm.py", "warm_rank.py"):  # the warm process's own code: each file of it
        with open(project / "trainer" / own, "a") as f:
            f.write("# a one-line change\n")
        assert _script(project)[1] not in ("", key), own
        key = _script(project)[1]
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


def test_slipway_run_tells_each_ranks_start_and_the_first_cold_one_on_the_terminal(tmp_path, capfd):
    """The clients' lines (trainer/warm.py) as `slipway run` reads them from the batch script: each
    rank's start an event as it comes, the first cold one a line on the terminal, none of theirs there."""
    import io

    from common.events import read_events
    from jobs.supervisor import Output, Stopper

    run = tmp_path / "run"
    run.mkdir()
    lines = ["slipway-warm node1: rank 0 started warm (pid 5)", "slipway-warm node2: the node step started warm (pid 6)",
             "slipway-warm node2: rank 2 starts cold: its environment differs from the warm process's in HF_HUB_OFFLINE",
             "slipway-warm node2: rank 3 starts cold: \x1b]0;no warm process on this node", "step 1/2 loss 5.0"]
    with (tmp_path / "log").open("w") as log:
        Output(io.BytesIO("\n".join(lines).encode() + b"\n"), log, Stopper(run, "t")).run()
    said = capfd.readouterr().out.splitlines()
    assert said == ["warm: rank 2 on node2 started cold: its environment differs from the warm process's in "
                    "HF_HUB_OFFLINE (each rank's start: events.log)", "step 1/2 loss 5.0"]
    assert [e.text for e in read_events(run)] == [
        "warm: rank 0 on node1 started warm", "warm: the node step on node2 started warm",
        "warm: rank 2 on node2 started cold: its environment differs from the warm process's in HF_HUB_OFFLINE",
        "warm: rank 3 on node2 started cold: \\x1b]0;no warm process on this node"]
    assert (tmp_path / "log").read_text().count("slipway-warm ") == 4


@pytest.mark.parametrize("proctrack", ["proctrack/cgroup", "proctrack/linuxproc"])
def test_doctor_says_warm_ranks_are_off_where_slurm_tracks_processes_by_cgroup(project, tmp_path, proctrack):
    from conftest import stand_in

    bin_dir = tmp_path / "fake-slurm"
    for tool in ("sbatch", "srun", "squeue"):
        stand_in(bin_dir, tool, "exit 0\n")
    stand_in(bin_dir, "scontrol", '[ "$1" = ping ] && echo "Slurmctld(primary) at n1 is UP"\n'
                                  f'[ "$1" = show ] && printf "ProctrackType           = {proctrack}\\nTaskPlugin = task/none\\n"\n'
                                  "exit 0\n")
    r = subprocess.run([PY, "-m", "jobs", "doctor", "tiny_cpu"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "COLUMNS": "400"})
    said = [line for line in r.stdout.splitlines() if "warm ranks" in line]
    expected = ("note: off here, slipway run starts every rank cold: Slurm tracks processes by cgroup "
                "(ProctrackType=proctrack/cgroup), where a forked rank would be its warm step's"
                if proctrack == "proctrack/cgroup" else "slipway run starts its ranks from warm processes (launch.warm)")
    assert len(said) == 1 and expected in said[0], r.stdout
