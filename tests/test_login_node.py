"""The login node's install: `pip install slipway` with the base dependencies only.

A fresh venv (built once for this module) holds the checkout installed as a user installs it
(not editable) with plumbum, pyyaml, tomli-w and rich, and no torch, numpy,
tokenizers, datasets or matplotlib. Through its own `slipway` every host command
runs (submit up to a stand-in sbatch, status, logs, watch, cancel, doctor, edf,
shell, prepare --as-job), and those that do the trainer's work here (prepare,
plot, local) say in one line which extra to install, exit 2, writing nothing.
Nowhere a traceback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT, squeue_answering, stand_in, tree

# What the trainer and plot extras bring: none of it may be importable in the venv.
NOT_INSTALLED = ("torch", "numpy", "tokenizers", "datasets", "safetensors", "matplotlib")


@dataclass
class BaseVenv:
    dir: Path

    @property
    def python(self) -> Path:
        return self.dir / "bin" / "python"

    @property
    def slipway(self) -> Path:
        return self.dir / "bin" / "slipway"


def _checkout_files() -> list[str]:
    """The checkout as it stands (tracked and new files, not what .gitignore leaves out)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without the test's own venv or Python path: only the base venv is seen."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "SLIPWAY_PROJECT", "SLIPWAY_RUNS", "SLIPWAY_DEBUG")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and not (Path(p).parent / "pyvenv.cfg").exists())
    return {**env, **extra}


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory) -> BaseVenv:
    """The checkout, copied (its build writes nowhere in the checkout) and pip-installed into a new venv."""
    top = tmp_path_factory.mktemp("login-node")
    src = top / "src"
    for name in _checkout_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    venv = BaseVenv(top / "venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv.dir)], check=True, env=_clean_env(), timeout=300)
    pip = [str(venv.python), "-m", "pip", "--disable-pip-version-check", "--no-input"]
    # Only a missing index is a reason to skip: fetch one small base dependency first.
    probe = subprocess.run([*pip, "download", "--no-deps", "-q", "-d", str(top / "probe"), "plumbum"],
                           capture_output=True, text=True, env=_clean_env(), timeout=300)
    if probe.returncode != 0:
        last = (probe.stderr.strip() or probe.stdout.strip() or "no output").splitlines()[-1]
        pytest.skip(f"pip cannot reach a package index to install the base dependencies: {last}")
    r = subprocess.run([*pip, "install", "-q", str(src)], capture_output=True, text=True, env=_clean_env(),
                       timeout=600)
    assert r.returncode == 0, f"pip install of the checkout failed:\n{r.stdout}\n{r.stderr}"
    return venv


def run(venv: BaseVenv, *args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run([str(venv.slipway), *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                       env=_clean_env(**(env or {})))
    assert "Traceback" not in r.stdout + r.stderr, f"slipway {' '.join(args)}:\n{r.stdout}\n{r.stderr}"
    return r


def ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, (r.args, r.stdout, r.stderr)
    return r.stdout


def one_line(r: subprocess.CompletedProcess, prefix: str) -> str:
    assert r.returncode == 2, (r.args, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"slipway: error: {prefix}"), r.stderr
    return lines[0]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    proj = tmp_path / "project"
    (proj / "configs").mkdir(parents=True)
    for cfg in (ROOT / "configs").glob("*.yaml"):
        shutil.copy(cfg, proj / "configs" / cfg.name)
    return proj


@pytest.fixture
def slurm(tmp_path: Path) -> dict[str, str]:
    """Slurm's client tools as stand-ins that log their arguments to $SLURM_CALLS: sbatch hands out job
    ids from 4241, squeue reports each job in the state its file holds, scancel cancels."""
    bin_dir, calls = tmp_path / "slurm-bin", tmp_path / "slurm-calls"
    log = 'echo "$(basename "$0") $*" >> "$SLURM_CALLS"\n'
    stand_in(bin_dir, "sbatch", log + 'n=$(( $(grep -c "^sbatch" "$SLURM_CALLS") + 4240 ))\n'
                                      'echo RUNNING > "$SLURM_CALLS.$n"\necho "$n"\n')
    stand_in(bin_dir, "scontrol", log + """case "$1" in
  ping) echo "Slurmctld(primary) at stand-in is UP" ;;
  show) [ "$2" = hostnames ] && echo "$3" ;;
esac
""")
    stand_in(bin_dir, "squeue", log + squeue_answering('$(cat "$SLURM_CALLS.$id")'))
    stand_in(bin_dir, "scancel", log + 'for id in "$@"; do echo CANCELLED > "$SLURM_CALLS.$id"; done\n')
    stand_in(bin_dir, "srun", log)
    calls.touch()
    return {"PATH": f"{bin_dir}{os.pathsep}{_clean_env()['PATH']}", "SLURM_CALLS": str(calls)}


def calls(slurm: dict[str, str], tool: str) -> list[str]:
    return [line for line in Path(slurm["SLURM_CALLS"]).read_text().splitlines() if line.startswith(f"{tool} ")]


# ---------------------------------------------------------------- the install itself


@pytest.mark.slow
def test_the_venv_holds_the_base_install_only(base_venv, tmp_path):
    code = ("import importlib.util, jobs, sys; "
            f"print([m for m in {NOT_INSTALLED!r} if importlib.util.find_spec(m)]); print(jobs.__file__)")
    out = subprocess.run([str(base_venv.python), "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env=_clean_env(), check=True).stdout.splitlines()
    assert out[0] == "[]", f"the trainer's dependencies are installed in the login node's venv: {out[0]}"
    assert Path(out[1]).is_relative_to(base_venv.dir), f"slipway comes from {out[1]}, not the installed copy"
    for module in ("torch", "numpy"):
        r = subprocess.run([str(base_venv.python), "-c", f"import {module}"], cwd=tmp_path, capture_output=True,
                           text=True, env=_clean_env())
        assert r.returncode == 1 and "ModuleNotFoundError" in r.stderr


@pytest.mark.slow
def test_every_host_module_imports(base_venv, tmp_path):
    """jobs/, edf/, containers/ and the trainer modules a host command reaches, imported one by one."""
    code = """
import importlib, json, pkgutil, sys
failed = []
names = [f"{p}.{m.name}" for p in ("jobs", "edf", "containers")
         for m in pkgutil.iter_modules(importlib.import_module(p).__path__) if m.name != "__main__"]
for name in names + ["trainer.prepare", "trainer.data_cache", "common.extras", "trainer.plot", "common.edge"]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
print(json.dumps({"modules": len(names), "failed": failed,
                  "heavy": sorted({"torch", "numpy", "tokenizers", "datasets"} & set(sys.modules))}))
"""
    out = json.loads(subprocess.run([str(base_venv.python), "-c", code], cwd=tmp_path, capture_output=True,
                                    text=True, env=_clean_env(), check=True).stdout)
    assert out["failed"] == [] and out["heavy"] == [], out
    assert out["modules"] >= 15, out  # the packages were found (not an empty walk)


@pytest.mark.slow
def test_every_command_prints_its_help(base_venv, tmp_path):
    for command in ("submit", "prepare", "local", "edf", "shell", "doctor", "status", "logs", "watch", "cancel",
                    "plot", "image", "cluster"):
        assert "usage:" in ok(run(base_venv, command, "--help", cwd=tmp_path))
    assert "usage:" in ok(run(base_venv, "--help", cwd=tmp_path))


# ---------------------------------------------------------------- the host commands


@pytest.mark.slow
def test_dry_runs_and_checks_need_no_trainer(base_venv, project, slurm):
    before = tree(project)
    out = ok(run(base_venv, "submit", "tiny_cpu", "--dry-run", cwd=project))
    assert "job.sbatch <==" in out and "dry run: nothing written" in out
    out = ok(run(base_venv, "shell", "tiny_cpu", "--dry-run", cwd=project))
    assert out.startswith("srun ") and "--pty bash" in out
    edf_config = {"SCRATCH": str(project)}
    assert "image = " in ok(run(base_venv, "edf", "tiny_wikitext", cwd=project, env=edf_config))
    assert tree(project) == before  # nothing written by any of them
    image, edf_path = project.parent / "image.sqsh", project.parent / "edf"
    image.write_bytes(b"hsqs" + bytes(1000))  # --install wants an image to pin; only its bytes are read
    edf_path.mkdir()
    edf = Path(ok(run(base_venv, "edf", "tiny_wikitext", f"container.image={image}", "--install", cwd=project,
                      env={**edf_config, "EDF_PATH": str(edf_path)})).strip())
    assert edf.parent == edf_path and f'image = "{image}"' in edf.read_text()
    assert f"{edf}: ok" in ok(run(base_venv, "edf", "--check", str(edf), cwd=project, env=edf_config))
    assert f"--container-image={image}" in ok(run(base_venv, "edf", "--to-pyxis", str(edf), cwd=project,
                                                  env=edf_config))
    out = ok(run(base_venv, "doctor", "tiny_cpu", cwd=project, env=slurm))
    assert "0 failed" in out and "ok   scontrol" in out
    r = run(base_venv, "cluster", "status", cwd=project)
    assert r.returncode in (0, 1) and r.stdout.startswith("cluster "), r.stdout
    assert run(base_venv, "cluster", "env", cwd=project).returncode in (0, 1)


@pytest.mark.slow
def test_submit_status_logs_watch_cancel_reach_slurm(base_venv, project, slurm):
    out = ok(run(base_venv, "submit", "tiny_cpu", cwd=project, env=slurm))
    job = "4241"
    assert job in out.split() and calls(slurm, "sbatch") == [f"sbatch --parsable {project}/runs/tiny_cpu/job.sbatch"]
    assert "RUNNING" in ok(run(base_venv, "status", cwd=project, env=slurm))
    assert "RUNNING" in ok(run(base_venv, "status", "tiny_cpu", cwd=project, env=slurm))
    (project / "runs" / "tiny_cpu" / "logs" / f"{job}.out").write_text("step 1 loss 10.5\n")
    assert "step 1 loss 10.5" in ok(run(base_venv, "logs", "tiny_cpu", cwd=project, env=slurm))
    assert ok(run(base_venv, "watch", "tiny_cpu", "--once", cwd=project, env=slurm))
    assert f"cancelled {job}" in ok(run(base_venv, "cancel", "tiny_cpu", cwd=project, env=slurm))
    assert calls(slurm, "scancel") == [f"scancel --signal=USR2 --batch {job}"]  # its trap ends it
    out = ok(run(base_venv, "prepare", "tiny_cpu", "--as-job", cwd=project, env=slurm))
    assert "4242" in out.split()
    assert calls(slurm, "sbatch")[-1] == f"sbatch --parsable {project}/runs/tiny_cpu/prepare.sbatch"


# ---------------------------------------------------------------- what needs the trainer's extras


@pytest.mark.slow
def test_trainer_work_here_names_the_extra_to_install(base_venv, project, slurm):
    ok(run(base_venv, "submit", "tiny_cpu", cwd=project, env=slurm))
    before = tree(project)
    line = one_line(run(base_venv, "prepare", "tiny_cpu", cwd=project), "prepare: needs numpy")
    assert "pip install 'slipway[trainer]'" in line and "slipway prepare tiny_cpu --as-job" in line
    line = one_line(run(base_venv, "local", "tiny_cpu", "run.name=here", cwd=project), "local: needs torch")
    assert "pip install 'slipway[trainer]'" in line
    line = one_line(run(base_venv, "plot", "tiny_cpu", cwd=project), "plot: needs matplotlib")
    assert "pip install 'slipway[plot]'" in line
    line = one_line(run(base_venv, "gpu-check", "--out", "report", cwd=project), "gpu-check: needs torch")
    assert "make gpu-check-wheels" in line  # the way onto a node without network
    assert tree(project) == before  # no cache, no run, no curves, no report


def test_the_extras_named_are_those_pyproject_declares():
    """`common.extras` says which extra brings a module: the same lists as pyproject.toml's."""
    tomllib = pytest.importorskip("tomllib")
    from common.extras import EXTRAS

    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        declared = {re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].replace("-", "_") for req in optional[extra]}
        assert set(modules) == declared, (extra, modules, declared)
