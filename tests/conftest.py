"""Shared fixtures. The real local Slurm cluster is `slipway cluster` (jobs/devcluster/)."""

from __future__ import annotations

import difflib
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

# A suite started from a background job inherits SIGINT ignored, and so would every process it
# starts: bash cannot trap a signal ignored on entry, and Python starts with no KeyboardInterrupt.
# Its processes start as from a terminal, so that the Ctrl-C paths are tested wherever it runs.
signal.signal(signal.SIGINT, signal.default_int_handler)

# The warm processes the suite starts keep their sockets and secrets in a folder of its own under
# /dev/shm (which containers share), never in the user's: a warm process clears what dead ones of
# any allocation left in its folder, and the suite acts on nothing of another checkout's. Made by
# the session and each xdist worker, not at import: a process that only imports a test module (a
# spawn Pool's worker, ended by terminate() without its atexit functions) must leave no folder.
def pytest_configure(config) -> None:
    os.environ["SLIPWAY_WARM_DIR"] = tempfile.mkdtemp(prefix="slipway-tests-",
                                                      dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


def pytest_unconfigure(config) -> None:
    shutil.rmtree(os.environ.pop("SLIPWAY_WARM_DIR"), ignore_errors=True)


ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
# The first lines of an `srun` stand-in for batch scripts run outside Slurm: the per-node
# helper does nothing, the verification runs for real once per node of the job, the preflight
# passes on every node (the node step keeps its arguments in $RUN_DIR/srun-preflight-args); any
# other call falls through to the lines after.
SRUN_PASSING_PREFLIGHT = """case " $* " in
  *" slipway-verify "*) while [ "${1#--}" != "$1" ]; do shift; done  # the node check itself, once per node
    for n in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do SLURMD_NODENAME=$n "$@"; done
    exit 0 ;;
  *" trainer.preflight node "*) printf "%s\\n" "$@" > "$RUN_DIR/srun-preflight-args"
    for n in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do echo "slipway-preflight $n ok: stand-in"; done
    exit 0 ;;
  *" trainer.preflight allreduce "*) echo "slipway-preflight-allreduce ok: stand-in"; exit 0 ;;
  *" --overlap "*) exit 0 ;;  # the node helper, container removals and sweeps: nothing here
esac
"""


def assert_golden(name: str, text: str) -> None:
    """Compare `text` with tests/golden/NAME; UPDATE_GOLDEN=1 rewrites it."""
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1" or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if os.environ.get("UPDATE_GOLDEN") != "1":
            pytest.fail(f"golden file {path} did not exist; written now, check it in")
    expected = path.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                            f"golden/{name}", "rendered"))
        pytest.fail(f"rendered output differs from golden/{name} (UPDATE_GOLDEN=1 to accept):\n{diff}")


@pytest.fixture
def project(tmp_path: Path, monkeypatch) -> Path:
    """A project directory with a hostile name (spaces, quotes, `$()`) holding configs/."""
    proj = tmp_path / "my proj 'q' \"dq\" $(touch pwned)"
    (proj / "configs").mkdir(parents=True)
    for cfg in (ROOT / "configs").glob("*.yaml"):
        (proj / "configs" / cfg.name).write_text(cfg.read_text())
    monkeypatch.chdir(proj)
    monkeypatch.setenv("SLIPWAY_PROJECT", str(proj))
    # This installation's `slipway` first on PATH, as in an activated venv: suggested commands then
    # read `slipway ...` (tests/test_first_hour.py checks them without it, as `make setup` leaves a shell).
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("SLIPWAY_RUNS", raising=False)
    return proj


@pytest.fixture(autouse=True)
def no_real_podman(request, monkeypatch, tmp_path_factory) -> None:
    """The machine's podman storage holds other projects' and other people's images: only a test
    marked `podman` reaches the real podman (and acts on the images it labelled itself). Any other
    finds, first on PATH, a podman that refuses, so one that lacks its stand-in fails instead of
    touching them; stand-ins put first on PATH by the test still answer."""
    if request.node.get_closest_marker("podman") is not None:
        return
    guard = tmp_path_factory.getbasetemp() / "no-real-podman"
    if not (guard / "podman").exists():
        guard.mkdir(exist_ok=True)
        tmp = guard / f".podman.{os.getpid()}"
        tmp.write_text('#!/bin/sh\necho "podman: a test not marked podman must not reach the real podman '
                       '(tests/conftest.py no_real_podman): put a stand-in first on PATH" >&2\nexit 97\n')
        tmp.chmod(0o755)
        os.replace(tmp, guard / "podman")
    monkeypatch.setenv("PATH", f"{guard}{os.pathsep}{os.environ['PATH']}")


def write_libraries(run_dir: Path, env) -> None:
    """The pinned job libraries a batch script of `env`'s runtime sources, into `run_dir` (what a
    submission writes beside job.sbatch), for scripts rendered and run by a test."""
    from common.rundir import RunDir
    from jobs.slurm.script import library_files

    for path, text in library_files(env, RunDir(run_dir)).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def default_signals() -> None:
    """preexec_fn for a process a test will signal: a test run from a background job (`make
    test-fast &`) starts with SIGINT and SIGQUIT ignored, under nohup SIGHUP too, which every child
    would inherit (and Python installs no KeyboardInterrupt handler then). The test sets the
    defaults itself, as a terminal's session has them."""
    import signal

    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def stand_in(bin_dir: Path, name: str, body: str) -> None:
    """An executable bash script `bin_dir/name` standing in for a tool (put bin_dir first on PATH)."""
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text("#!/bin/bash\n" + body)
    (bin_dir / name).chmod(0o755)


def squeue_answering(state: str) -> str:
    """The body of a squeue stand-in that answers slipway's query (jobs/slurm `squeue_argv`) as Slurm
    prints it, one line per job id asked about, in the state the shell word `state` gives ($id: the job)."""
    return ('for a in "$@"; do case "$a" in --jobs=*) jobs=${a#--jobs=} ;; esac; done\n'
            f'for id in ${{jobs//,/ }}; do echo "$id|{state}|None|0:00|node1|0|x"; done\n')


def git(project: Path, *args: str) -> None:
    import subprocess

    subprocess.run(["git", "-C", str(project), *args], check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"})


@pytest.fixture
def checkout(project: Path) -> Path:
    """The project as a git checkout of slipway's code folders (what a user clones)."""
    import shutil

    for name in ("common", "trainer"):
        shutil.copytree(ROOT / name, project / name, ignore=shutil.ignore_patterns("__pycache__"))
    git(project, "init", "-q")
    git(project, "add", "common", "trainer", "configs")
    git(project, "commit", "-qm", "c")
    return project


def tree(path: Path) -> list[str]:
    """Every file and directory under `path`, for "nothing was written" checks."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


from slurm_fixtures import restart_dead_session_nodes, slurm_cluster, slurm_env  # noqa: E402,F401  (a real local Slurm)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    restart_dead_session_nodes()  # before the test's fixtures: a module fixture may submit jobs


# `make test` runs two pytest-xdist workers. Each module's tests stay on one worker (module
# fixtures are built once), and these share one, whole, one after another: the modules that
# drive the real local Slurm cluster (one session cluster per machine, at fixed names,
# addresses and state directory), and those that build images with podman.
SHARED_WORKER = {
    "slurm": {"test_cluster.py", "test_clusters_slurm.py", "test_dev_loop.py", "test_e2e.py", "test_environ.py",
              "test_hang_slurm.py", "test_submit.py", "test_sweep.py", "test_watch.py"},
    "podman": {"test_image.py", "test_image_project.py", "test_pyxis.py"},
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Whole modules to workers (as --dist loadfile), SHARED_WORKER's sets as one unit each.
    Not xdist's loadgroup: its groups ride on mutated node ids, which pytest 9.2 no longer
    honours (pytest-xdist#1386), and a split Slurm group would start two clusters at once."""
    from xdist.scheduler import LoadScopeScheduling

    unit = {name: group for group, names in SHARED_WORKER.items() for name in names}

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return unit.get(Path(module).name, module)

    return ByModule(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    """A test on the session Slurm cluster, or one that builds with podman, in a module that
    SHARED_WORKER does not name would run beside the others of its kind: refuse the run."""
    for item in items:
        name = Path(str(item.fspath)).name
        needs = {"slurm": "slurm_cluster" in getattr(item, "fixturenames", ()),
                 "podman": item.get_closest_marker("podman") is not None}
        for kind, needed in needs.items():
            if needed and name not in SHARED_WORKER[kind]:
                raise pytest.UsageError(f"{item.nodeid} uses {kind} but {name} is not in SHARED_WORKER[{kind!r}] "
                                        "in tests/conftest.py: add it there")
