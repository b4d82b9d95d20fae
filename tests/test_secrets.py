"""Secrets never land anywhere (docs/secrets.md).

Through the command line as a user types it, on every runtime: variables named in
`container.env_from_host` reach the job (the batch script's sruns, pyxis' --container-env,
the Container Engine's `${VAR}`), `slipway local` and `slipway shell`, while their values
appear in no file slipway writes, in no output it prints, and in no line `launch.debug`'s
`set -x` traces. A secret given a value in a config is refused in one line that never shows
it; run directories are never world-writable, whatever the umask.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from plumbum import local

from conftest import SRUN_PASSING_PREFLIGHT, squeue_answering, tree
from jobs.cli import main

PY = sys.executable
# Unique values: any file or output holding one of them has leaked it.
MARKERS = {"HF_TOKEN": "hf_" + secrets.token_hex(12), "WANDB_API_KEY": "wb" + secrets.token_hex(16)}
FROM_HOST = "container.env_from_host=[HF_TOKEN, WANDB_API_KEY]"
RUNTIMES = ["edf", "pyxis", "none"]


def stand_in(bin_dir: Path, name: str, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text("#!/bin/bash\n" + body)
    (bin_dir / name).chmod(0o755)


# What a stand-in saw, written without a value: `NAME set` for each variable it was handed.
SAW = ('echo "HF_TOKEN ${HF_TOKEN:+set}"; echo "WANDB_API_KEY ${WANDB_API_KEY:+set}"; '
       'printf "arg %s\\n" "$@"')


@pytest.fixture
def host(project: Path, tmp_path: Path, monkeypatch):
    """The submitting shell: the two secrets exported, stand-ins for Slurm's commands first on
    PATH (plumbum keeps its own copy of the environment, so both are set)."""
    bin_dir = tmp_path / "fake-slurm"
    seen = tmp_path / "seen"
    seen.mkdir()
    stand_in(bin_dir, "sbatch", f'{{ {SAW}; }} > {shlex.quote(str(seen))}/sbatch\necho "$((RANDOM + 100))"\n')
    stand_in(bin_dir, "scontrol", 'case "$1 $2" in "ping "*) echo "Slurmctld(primary) at n1 is UP" ;;\n'
                                  '  *) echo n1 ;; esac\n')
    stand_in(bin_dir, "squeue", squeue_answering("COMPLETED"))
    # The shell's srun: what it was handed, and the modes of the EDF it was pointed at.
    stand_in(bin_dir, "srun", "{ " + SAW + "\n"
                              'for a in "$@"; do case "$a" in --environment=*) f=${a#--environment=}\n'
                              '  stat -c "edf %a" "$f"; stat -c "dir %a" "${f%/*}" ;; esac; done; } '
                              f'> {shlex.quote(str(seen))}/srun\n')
    values = {**MARKERS, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SBATCH_EXPORT", raising=False)
    umask = os.umask(0o022)
    img = project / "img.sqsh"
    img.write_bytes(b"hsqs")
    with local.env(**values):
        yield seen
    os.umask(umask)


def slipway(capfd, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capfd.readouterr()
    return rc, out, err


def runtime_args(project: Path, runtime: str) -> list[str]:
    image = [f"container.image={project / 'img.sqsh'}"] if runtime != "none" else []
    return [f"container.runtime={runtime}", *image, FROM_HOST]


def leaks(*texts: str, under: Path | None = None) -> list[str]:
    """Where a marker value appears: in the given texts, or in any file under `under`."""
    found = [f"output {i}" for i, text in enumerate(texts) for v in MARKERS.values() if v in text]
    if under is not None:
        for path in under.rglob("*"):
            if path.is_file() and any(v.encode() in path.read_bytes() for v in MARKERS.values()):
                found.append(str(path))
    return found


# ------------------------------------------------------------------ every runtime, every command


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_secrets_reach_the_job_and_land_nowhere(project, host, capfd, runtime):
    args = ["tiny_cpu", *runtime_args(project, runtime), "launch.debug=true", "--run-name", "sec"]
    outputs = []
    for command in (["submit", "--dry-run"], ["submit"], ["doctor"],
                    *([["edf"]] if runtime != "none" else [])):
        rc, out, err = slipway(capfd, *command, *args)
        outputs += [out, err]
        assert rc == 0 or command == ["doctor"], (command, out, err)  # no controller answers the doctor
        assert "export HF_TOKEN" not in out + err and "export WANDB_API_KEY" not in out + err
    run_dir = project / "runs" / "sec"
    assert (run_dir / "manifest.json").is_file()
    # sbatch was handed both (its default --export=ALL takes them into the job)
    assert "HF_TOKEN set" in (host / "sbatch").read_text() and "WANDB_API_KEY set" in (host / "sbatch").read_text()
    script = (run_dir / "job.sbatch").read_text()
    assert "set -x" in script
    if runtime == "edf":
        env_toml = (run_dir / "env.toml").read_text()
        assert 'HF_TOKEN = "${HF_TOKEN}"' in env_toml and 'WANDB_API_KEY = "${WANDB_API_KEY}"' in env_toml
    if runtime == "pyxis":
        # the training step's line: the code snapshot's variables are set for it alone, before srun
        srun = next(line for line in script.splitlines() if "srun --kill-on-bad-exit=1 --wait=" in line)
        flag = next(w for w in shlex.split(srun.rstrip("\\")) if w.startswith("--container-env="))
        assert {"HF_TOKEN", "WANDB_API_KEY"} <= set(flag.split("=", 1)[1].split(","))
        assert "HF_TOKEN=" not in script and "WANDB_API_KEY=" not in script  # named, never assigned
    assert not leaks(*outputs, under=project)

    # The batch script itself, traced (launch.debug): its sruns get both, its trace shows neither.
    trace = run_batch_script(run_dir, host.parent / "job-bin")
    srun_saw = (run_dir / "srun-saw").read_text()
    assert "HF_TOKEN set" in srun_saw and "WANDB_API_KEY set" in srun_saw, srun_saw
    assert "+ " in trace and not leaks(trace, srun_saw, under=project)


def run_batch_script(run_dir: Path, bin_dir: Path) -> str:
    """job.sbatch under bash with stand-in srun/scontrol and the secrets in its environment, as
    sbatch starts it; its output and set -x trace."""
    stand_in(bin_dir, "scontrol", "echo n1\n")
    stand_in(bin_dir, "srun", SRUN_PASSING_PREFLIGHT + f'{{ {SAW}; }} >> "$RUN_DIR/srun-saw"\n')
    log = run_dir.parent.parent.parent / "job-trace.out"  # outside the project: it is read, then scanned
    with log.open("w") as out:
        r = subprocess.run(["bash", str(run_dir / "job.sbatch")], stdout=out, stderr=subprocess.STDOUT, timeout=120,
                           env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(run_dir), "SLURM_NNODES": "1",
                                "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "RUN_DIR": str(run_dir),
                                **MARKERS})
    trace = log.read_text()
    assert r.returncode == 0, trace
    return trace


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_shell_hands_secrets_on_and_keeps_no_file(project, host, capfd, runtime):
    args = ["tiny_cpu", *runtime_args(project, runtime), "launch.debug=true"]
    rc, out, err = slipway(capfd, "shell", *args, "--dry-run")
    assert rc == 0, err
    outputs = [out, err]
    if runtime == "edf":
        assert 'HF_TOKEN = "${HF_TOKEN}"' in out  # the EDF, as it would be written
    if runtime == "pyxis":
        assert "--container-env=HF_TOKEN,WANDB_API_KEY" in out
    assert not (project / "runs").exists()  # a dry run writes nothing
    rc, out, err = slipway(capfd, "shell", *args, "--command", "true")
    assert rc == 0, err
    outputs += [out, err]
    seen = (host / "srun").read_text()
    assert "HF_TOKEN set" in seen and "WANDB_API_KEY set" in seen, seen
    assert "arg true" in seen and "arg --pty" not in seen
    if runtime == "edf":
        # private while srun runs, and gone once the shell has ended
        assert "edf 600" in seen and "dir 700" in seen, seen
        assert list((project / "runs" / ".shell").iterdir()) == []
    if runtime == "pyxis":
        assert "arg --container-env=HF_TOKEN,WANDB_API_KEY" in seen
    assert not leaks(*outputs, seen, under=project)


def test_local_takes_them_from_its_own_environment(project, host, capfd):
    code = "import os; print('got', sorted(k for k in ('HF_TOKEN', 'WANDB_API_KEY') if os.environ.get(k)))"
    rc, out, err = slipway(capfd, "local", "tiny_cpu", FROM_HOST, "launch.procs_per_node=1", "--run-name", "loc",
                           f"launch.command=[{PY}, -c, {json.dumps(code)}]")
    assert rc == 0, (out, err)
    assert "got ['HF_TOKEN', 'WANDB_API_KEY']" in out
    assert not leaks(out, err, under=project)


# ------------------------------------------------------------------ a variable not exported


@pytest.mark.parametrize("command", [["submit"], ["local"], ["shell", "--command", "true"]])
def test_an_unset_variable_is_refused_in_one_line(project, host, capfd, monkeypatch, command):
    monkeypatch.delenv("WANDB_API_KEY")
    before = tree(project)
    rc, out, err = slipway(capfd, command[0], "tiny_cpu", FROM_HOST, *command[1:])
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("slipway: error: container.env_from_host:"), err
    assert "export WANDB_API_KEY=..." in lines[0] and "HF_TOKEN" not in lines[0]
    assert tree(project) == before


@pytest.mark.parametrize("command", [["submit", "--dry-run"], ["shell", "--dry-run"]])
def test_a_dry_run_says_it_as_a_note(project, host, capfd, monkeypatch, command):
    monkeypatch.delenv("HF_TOKEN")
    rc, out, err = slipway(capfd, *command, "tiny_cpu", FROM_HOST)
    assert rc == 0, err
    notes = [line for line in (out + err).splitlines() if line.startswith("note:") and "env_from_host" in line]
    assert len(notes) == 1 and "export HF_TOKEN=..." in notes[0], out + err


def test_an_export_that_drops_them_is_refused(project, host, capfd, monkeypatch):
    rc, _, err = slipway(capfd, "submit", "tiny_cpu", FROM_HOST, "slurm.extra=[--export=NONE]")
    assert rc == 2 and err.startswith("slipway: error: slurm.extra[0]:") and "--export=ALL" in err
    monkeypatch.setenv("SBATCH_EXPORT", "PATH,HF_TOKEN")
    rc, _, err = slipway(capfd, "submit", "tiny_cpu", FROM_HOST)
    assert rc == 2 and err.startswith("slipway: error: SBATCH_EXPORT:") and "WANDB_API_KEY" in err
    monkeypatch.setenv("SBATCH_EXPORT", "ALL")
    assert slipway(capfd, "submit", "tiny_cpu", FROM_HOST)[0] == 0


# ------------------------------------------------------------------ secrets given a value


@pytest.mark.parametrize("field, name", [
    ("container.env", "HF_TOKEN"), ("container.env", "hf_token"), ("container.env", "wandb_key"),
    ("container.env", "my_api_key"), ("container.env", "DB_PASSWD"), ("container.env", "Aws_Secret_Access_Key"),
    ("launch.env", "WANDB_API_KEY"), ("launch.env", "hf_token"), ("launch.env", "wandb_key"),
    ("launch.env", "my_api_key"), ("launch.env", "GIT_CREDENTIALS"),
    ("image.build_args", "HF_TOKEN"), ("image.build_args", "my_api_key"), ("image.build_args", "private_key"),
])
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_secret_given_a_value_is_refused(project, host, capfd, field, name, runtime):
    before = tree(project)
    value = MARKERS["HF_TOKEN"]
    rc, out, err = slipway(capfd, "submit", "tiny_cpu", *runtime_args(project, runtime)[:-1],
                           f"{field}.{name}={value}")
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"slipway: error: {field}.{name}: looks like a secret"), err
    assert f"container.env_from_host: [{name}]" in lines[0] and f"export {name}=..." in lines[0]
    assert not leaks(out, err) and tree(project) == before


@pytest.mark.parametrize("override, field", [
    ("container.env.HF_TOKEN=${OTHER}", "container.env.HF_TOKEN"),  # only its own name passes through
    ("container.env.HEADER=Bearer ${HF_TOKEN}", "container.env.HEADER"),  # pyxis would trace the value
    ("launch.env.HEADER=Bearer ${WANDB_API_KEY}", "launch.env.HEADER"),
    ("launch.env.HF_TOKEN=${HF_TOKEN}", "launch.env.HF_TOKEN"),  # exported by the script's text
])
def test_values_that_would_expand_a_secret_into_the_script_are_refused(project, host, capfd, override, field):
    rc, _, err = slipway(capfd, "submit", "tiny_cpu", "container.runtime=pyxis",
                         f"container.image={project / 'img.sqsh'}", override)
    assert rc == 2 and err.startswith(f"slipway: error: {field}:") and "container.env_from_host: [" in err, err
    assert len(err.strip().splitlines()) == 1


def test_its_own_reference_is_a_pass_through_and_look_alikes_pass(project, host, capfd):
    """`HF_TOKEN: ${HF_TOKEN}` in container.env is what env_from_host writes into an EDF: allowed,
    and under pyxis named, never assigned. TOKENIZERS_PARALLELISM holds no secret."""
    rc, out, err = slipway(capfd, "submit", "--dry-run", "tiny_cpu", "container.runtime=pyxis",
                           f"container.image={project / 'img.sqsh'}", "container.env.HF_TOKEN=${HF_TOKEN}",
                           "container.env.TOKENIZERS_PARALLELISM=false", "launch.debug=true")
    assert rc == 0, err
    assert "--container-env=TOKENIZERS_PARALLELISM,SLIPWAY_CODE,PYTHONPATH,PYTHONSAFEPATH,HF_TOKEN" in out
    assert "HF_TOKEN=" not in out
    assert "TOKENIZERS_PARALLELISM=false" in out and not leaks(out, err)


@pytest.mark.parametrize("value, words", [
    ("[HF_TOKEN, HF_TOKEN]", "listed twice"), ("[1BAD]", "not a valid environment variable name"),
    ("[FOO-BAR]", "not a valid environment variable name"),
])
def test_env_from_host_names_are_checked(project, host, capfd, value, words):
    rc, _, err = slipway(capfd, "submit", "--dry-run", "tiny_cpu", f"container.env_from_host={value}")
    assert rc == 2 and err.startswith("slipway: error: container.env_from_host[") and words in err, err


def test_env_from_host_and_env_cannot_both_set_a_name(project, host, capfd):
    rc, _, err = slipway(capfd, "submit", "--dry-run", "tiny_cpu", "container.env_from_host=[FOO]",
                         "container.env.FOO=1")
    assert rc == 2 and "container.env_from_host[0]: FOO is also set in container.env" in err, err


# ------------------------------------------------------------------ permissions


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_run_directories_are_never_world_writable(project, host, capfd, umask):
    os.umask(umask)
    rc, _, err = slipway(capfd, "submit", "tiny_cpu", "--run-name", "perm")
    assert rc == 0, err
    run_dir = project / "runs" / "perm"
    for path in [run_dir, *run_dir.rglob("*"), project / "runs"]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert not mode & 0o002, (path, oct(mode))
    mode = stat.S_IMODE(run_dir.stat().st_mode)
    assert mode & 0o050 == 0o050, oct(mode)  # teammates read it, as the umask allows
    assert not list(run_dir.rglob(".*.tmp")) and not list(project.joinpath("runs").glob(".perm.*.tmp"))
    assert not stat.S_IMODE((project / "runs" / ".perm.lock").stat().st_mode) & 0o022  # the run's lock
    # a directory made world-writable before is fixed on the next submission
    os.chmod(run_dir, 0o777)
    assert slipway(capfd, "submit", "tiny_cpu", "--run-name", "perm")[0] == 0
    assert not stat.S_IMODE(run_dir.stat().st_mode) & 0o002


def test_a_base_environment_s_literal_is_replaced_or_refused_under_pyxis(project, host, capfd, tmp_path,
                                                                         monkeypatch):
    """Under pyxis a base EDF's [env] is resolved into the batch script: env_from_host replaces
    its entry of the same name; a secret-looking literal left there is refused like one in the config."""
    edf_dir = tmp_path / "edfs"
    edf_dir.mkdir()
    (edf_dir / "site.toml").write_text(f'[env]\nHF_TOKEN = "{MARKERS["HF_TOKEN"]}"\nFOO = "1"\n')
    monkeypatch.setenv("EDF_PATH", str(edf_dir))
    args = ["tiny_cpu", "container.runtime=pyxis", f"container.image={project / 'img.sqsh'}",
            "container.base_environment=[site]"]
    rc, out, err = slipway(capfd, "submit", "--dry-run", *args, FROM_HOST)
    assert rc == 0, err
    assert "--container-env=FOO,SLIPWAY_CODE,PYTHONPATH,PYTHONSAFEPATH,HF_TOKEN,WANDB_API_KEY" in out and not leaks(out, err)
    rc, out, err = slipway(capfd, "submit", "--dry-run", *args)
    assert rc == 2 and err.startswith("slipway: error: container.env.HF_TOKEN: looks like a secret"), err
    assert not leaks(out, err)


def test_an_export_with_a_secret_value_is_refused(project, host, capfd):
    before = tree(project)
    rc, out, err = slipway(capfd, "submit", "tiny_cpu", f"slurm.extra=[\"--export=ALL,HF_TOKEN={MARKERS['HF_TOKEN']}\"]")
    assert rc == 2 and err.startswith("slipway: error: slurm.extra[0]: looks like a secret"), err
    assert not leaks(out, err) and tree(project) == before
