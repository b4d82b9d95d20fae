"""The batch script: goldens for every runtime x launcher, hostile inputs, bash -n."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import SRUN_PASSING_PREFLIGHT, assert_golden, write_libraries
from jobs.config import load_config
from common.rundir import RunDir
from jobs.slurm.ranks import local_argv, shell_value
from jobs.slurm.script import render_sbatch

HOSTILE = "a b'c\"d $(touch pwned) `touch pwned2` ; rm -rf / \\ ${HOME} end"
PATHS = RunDir(Path("/scratch/u s'er/proj $(x)/runs/r1"), Path("/scratch/u s'er/proj $(x)"))


def pinned_names(text: str) -> str:
    """The script with its libraries' hashes as placeholders: the goldens check the rendered script,
    not the libraries (tests/test_job_lib.py does), so a library change leaves them alone."""
    return re.sub(r"(lib/[a-z_]+)-[0-9a-f]{12}\.sh [0-9a-f]{64}", r"\1-HASH12.sh SHA256", text)


def config(runtime: str, launcher: str, **extra):
    overrides = [
        "run.name=r1", f"container.runtime={runtime}", f"launch.launcher={launcher}",
        "launch.python=/usr/bin/python3", "slurm.nodes=2", "slurm.gpus_per_node=4", "launch.procs_per_node=4", "slurm.cpus_per_task=16",
        "parallel.dp=8", "slurm.account=a-01", "slurm.partition=normal", "slurm.email=me@example.org",
        "launch.pre_launch=[nvidia-smi -L]", "slurm.extra=[--exclusive]",
    ]
    if runtime != "none":
        overrides += ["container.image=/scratch/img dir/slipway 'v1'.sqsh",
                      "container.mounts=[/scratch/data dir:/data:ro, /users]", "container.workdir=/data",
                      "container.annotations.com.hooks.aws_ofi_nccl.enabled=true"]
    for k, v in extra.items():
        overrides.append(f"{k}={v}")
    return load_config("configs/tiny_cpu.yaml", overrides)


@pytest.mark.parametrize("runtime", ["edf", "pyxis", "none"])
@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_golden(runtime, launcher):
    cfg = config(runtime, launcher)
    if runtime == "pyxis":
        cfg.container.env = {"GREETING": HOSTILE, "EMPTY": ""}
    cfg.launch.env = {"FOO": HOSTILE, "DATA": "${SCRATCH}/data set"}
    text = render_sbatch(cfg, PATHS, cfg.container)
    assert_golden(f"sbatch/{runtime}-{launcher}.sbatch", pinned_names(text))
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_environment_goes_on_the_srun_line():
    cfg = config("edf", "torchrun")
    text = render_sbatch(cfg, PATHS, cfg.container)
    assert "#SBATCH --environment" not in text
    srun = [line for line in text.splitlines() if line.startswith("srun --kill-on-bad-exit")][0]
    assert "'--environment=/scratch/u s'\"'\"'er/proj $(x)/runs/r1/env.toml'" in srun


def test_cuda_device_max_connections_is_left_to_layouts_that_need_it():
    """FSDP2 overlaps its collectives on streams of their own, which CUDA_DEVICE_MAX_CONNECTIONS=1
    serialises: no job sets it; a train.script whose tensor parallel wants it (Megatron-LM,
    nanotron) sets it in launch.env."""
    for runtime in ("edf", "pyxis", "none"):
        assert "export CUDA_DEVICE_MAX_CONNECTIONS" not in render_sbatch(config(runtime, "torchrun"), PATHS,
                                                                           config(runtime, "torchrun").container)
    cfg = config("none", "torchrun", **{"launch.env.CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in render_sbatch(cfg, PATHS, cfg.container)


def _alloc_line(text: str) -> list[str]:
    return [line for line in text.splitlines() if "PYTORCH_ALLOC_CONF" in line or "PYTORCH_CUDA_ALLOC_CONF" in line]


@pytest.mark.parametrize("given, expected", [
    ({}, "expandable_segments:True"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, ""),  # torch would read ours first: none of ours
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, "expandable_segments:False"),
])
def test_gpu_ranks_get_expandable_segments_unless_the_environment_says_otherwise(given, expected):
    """A GPU job's ranks get PYTORCH_ALLOC_CONF=expandable_segments:True (the memory estimate's
    assumption), unless the submitting environment sets it or its older name; launch.env
    overrides it. The rendered lines run in bash as the job runs them."""
    text = render_sbatch(config("none", "torchrun"), PATHS, config("none", "torchrun").container)
    (line,) = [ln for ln in _alloc_line(text) if not ln.startswith("#")]
    env = {k: v for k, v in os.environ.items() if "ALLOC_CONF" not in k}
    out = subprocess.run(["bash", "-c", line + '\nprintf %s "${PYTORCH_ALLOC_CONF:-}"'], env={**env, **given},
                         capture_output=True, text=True, check=True).stdout
    assert out == expected
    cfg = config("none", "torchrun", **{"launch.env.PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert _alloc_line(render_sbatch(cfg, PATHS, cfg.container)) == [
        "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]  # launch.env's alone
    cpu = config("none", "torchrun", **{"slurm.gpus_per_node": "0", "launch.procs_per_node": "2", "parallel.dp": "4"})
    assert not _alloc_line(render_sbatch(cpu, PATHS, cpu.container))  # no CUDA allocator to set


def test_local_ranks_get_expandable_segments_too(monkeypatch, tmp_path):
    """`slipway local` (which may run on a GPU machine) sets the same, on the same terms."""
    from jobs.interactive import local_env

    class Run:
        dir = tmp_path
        paths = RunDir(tmp_path, tmp_path)

    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    cfg = load_config("configs/tiny_cpu.yaml", [])
    assert local_env(cfg, Run())["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    cfg.launch.env = {"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.6"}
    assert local_env(cfg, Run())["PYTORCH_ALLOC_CONF"] == "garbage_collection_threshold:0.6"
    cfg.launch.env = {}
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    assert "PYTORCH_ALLOC_CONF" not in local_env(cfg, Run())


@pytest.mark.parametrize("setting", [None, "${SCRATCH}/hf"])
@pytest.mark.parametrize("shell_has", [None, "/home/u/hf"])
def test_a_run_here_the_batch_script_and_prepare_put_hub_downloads_in_one_place(monkeypatch, tmp_path, setting,
                                                                                 shell_has):
    """launch.hf_home, else the shell's HF_HOME, else the project's cache: `slipway local` (and its
    --prepare), `slipway prepare` and the batch script read one rule, so a dataset prepared by one is
    found by the others."""
    from jobs.interactive import local_env
    from jobs.runs import preparation

    monkeypatch.setenv("SCRATCH", "/scratch/u")
    if shell_has:
        monkeypatch.setenv("HF_HOME", shell_has)
    else:
        monkeypatch.delenv("HF_HOME", raising=False)
    overrides = [f"launch.hf_home={setting}"] if setting else []
    cfg = load_config("configs/tiny_cpu.yaml", overrides)
    paths = RunDir(tmp_path / "runs" / "tiny_cpu", tmp_path)

    class Run:
        dir = paths.path

    Run.paths = paths
    line = next(ln for ln in render_sbatch(cfg, paths, cfg.container).splitlines() if "HF_HOME=" in ln)
    batch = subprocess.run(["bash", "-c", f"{line}; printf %s \"$HF_HOME\""], capture_output=True, text=True,
                           env=dict(os.environ), check=True).stdout
    expected = "/scratch/u/hf" if setting else shell_has or str(tmp_path / ".cache" / "huggingface")
    assert batch == local_env(cfg, Run())["HF_HOME"] == preparation(cfg, tmp_path)[1] == expected


def test_a_cluster_hf_home_naming_what_this_shell_lacks_is_the_project_cache_on_this_machine(monkeypatch, tmp_path):
    """tiny_wikitext's launch.hf_home is ${SCRATCH}/...: tried here without SCRATCH, the run uses
    this machine's cache and says so, instead of refusing; with SCRATCH set, the config's place."""
    from jobs.interactive import local_env
    from jobs.local_checks import local_view

    class Run:
        dir = tmp_path / "runs" / "r"
        paths = RunDir(tmp_path / "runs" / "r", tmp_path)

    monkeypatch.delenv("SCRATCH", raising=False)
    monkeypatch.delenv("HF_HOME", raising=False)
    cfg = load_config("configs/tiny_wikitext.yaml", [])
    local, changed = local_view(cfg, rename=True)
    assert "launch.hf_home ${SCRATCH}/huggingface_home -> the project's cache (it names a variable this shell does " \
           "not set)" in changed
    assert local_env(local, Run())["HF_HOME"] == str(tmp_path / ".cache" / "huggingface")
    monkeypatch.setenv("SCRATCH", "/scratch/u")
    local, changed = local_view(cfg, rename=True)
    assert not [c for c in changed if "hf_home" in c]
    assert local_env(local, Run())["HF_HOME"] == "/scratch/u/huggingface_home"


def test_debug_mode():
    cfg = config("none", "torchrun", **{"launch.debug": "true"})
    text = render_sbatch(cfg, PATHS, cfg.container)
    for needle in ("set -x", "CUDA_LAUNCH_BLOCKING=1", "NCCL_DEBUG=INFO", "TORCH_DISTRIBUTED_DEBUG=DETAIL"):
        assert needle in text


@pytest.mark.parametrize("value, expected", [
    (HOSTILE, HOSTILE.replace("${HOME}", "/h")),
    ("${SCRATCH}/x", "/s/x"),
    ("${A:-$(touch pwned)}", "${A:-$(touch pwned)}"),
    ("${A:-/fall back}", "/fall back"),
    ("", ""), ("plain", "plain"), ("$", "$"), ("$$", "$$"),
])
def test_shell_value_never_executes(tmp_path, value, expected):
    script = f"set -u; SCRATCH=/s; A=; HOME=/h; cd {shell_value(str(tmp_path))}; printf '%s' {shell_value(value)}"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    assert not list(tmp_path.iterdir()), "a value ran a command"
    assert out == expected


def test_hostile_script_runs_without_executing_anything(tmp_path):
    """Run the rendered script itself with stand-in Slurm commands: no value may execute."""
    proj = tmp_path / "p $(touch pwned) 'q'"
    run_dir = proj / "runs" / "r1"
    run_dir.mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\n' + SRUN_PASSING_PREFLIGHT +
                                  'out=srun-args; case " $* " in *" trainer.plot "*) out=srun-plot-args ;; esac\n'
                                  'for a in "$@"; do printf "%s\\n" "$a"; done > "$RUN_DIR/$out"\n'
                                  'printf "%s" "$SLIPWAY_PREFLIGHT_ALLREDUCE" > "$RUN_DIR/srun-preflight-env"\n')
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node1\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    cfg = config("pyxis", "srun")
    cfg.container.env = {"GREETING": HOSTILE}
    cfg.launch.env = {"FOO": HOSTILE}
    cfg.launch.pre_launch = []
    cfg.slurm.gpus_per_node = 0
    text = render_sbatch(cfg, RunDir(run_dir, proj), cfg.container)
    write_libraries(run_dir, cfg.container)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "17", "SLURM_JOB_NODELIST": "node1",
           "HOME": str(tmp_path)}
    subprocess.run(["bash", "-c", text], env={**env, "RUN_DIR": str(run_dir)}, cwd=tmp_path, check=True, timeout=30)
    assert not list(tmp_path.rglob("pwned*")), "a value ran a command"
    args = (run_dir / "srun-args").read_text().splitlines()
    assert "--container-env=GREETING" in " ".join(args) or any(a.startswith("--container-env") for a in args)
    assert args[-2:] == ["--config", str(run_dir / "config.yaml")]
    # The job trained all its steps: its last step draws the curves, the hostile path one word.
    plot = (run_dir / "srun-plot-args").read_text().splitlines()
    assert plot[-3:] == ["-m", "trainer.plot", str(run_dir)] and "--ntasks=1" in plot, plot
    preflight = (run_dir / "srun-preflight-args").read_text().splitlines()
    assert preflight[preflight.index("--run-dir") + 1] == str(run_dir)  # hostile path, one word
    assert preflight[preflight.index("--checkpoint-dir") + 1] == str(run_dir / "checkpoints")
    events = (run_dir / "events.log").read_text()
    assert "job 17 start on node1" in events and "job 17 end exit 0" in events
    # The all-reduce runs in the training step's process group: asked for through its environment.
    assert (run_dir / "srun-preflight-env").read_text() == "4 300"


@pytest.mark.parametrize("extra, launcher, why", [
    ({}, "srun", "slipway's trainer needs no torchrun agent"),
    ({"train.script": "scripts/my train.py"}, "torchrun", "train.script is your program"),
    ({"launch.command": "[/usr/bin/python3, -c, pass]"}, "torchrun", "launch.command is your program"),
    ({"launch.command": "[/bin/hostname]"}, "srun", "no Python program torchrun could start"),
])
def test_the_cheapest_equivalent_launcher_by_default(extra, launcher, why):
    """launch.launcher auto: slipway's trainer starts one srun task per rank, as torchrun's agents,
    asked for no elastic restarts, would only cost; the same script as launcher srun, and the
    choice said with its reason."""
    cfg = config("none", "auto", **extra)
    assert cfg.launcher == launcher and why in cfg.launch_choice[1], cfg.launch_choice
    same = config("none", launcher, **extra)
    assert render_sbatch(cfg, PATHS, cfg.container) == render_sbatch(same, PATHS, same.container)
    assert load_config("configs/tiny_cpu.yaml", []).launcher == "srun"  # the shipped configs take the default


def test_local_argv_is_the_same_launch():
    cfg = config("none", "torchrun", **{"slurm.nodes": 1, "parallel.dp": 4})
    argv = local_argv(cfg, PATHS)
    assert argv[:3] == ["/usr/bin/python3", "-m", "torch.distributed.run"]
    assert "--standalone" in argv and "--nproc-per-node=4" in argv
    assert argv[-4:] == ["-m", "trainer", "--config", str(PATHS.config)]


def test_custom_training_script_is_launched_the_same_way():
    cfg = config("none", "torchrun", **{"train.script": "scripts/my train.py"})
    text = render_sbatch(cfg, PATHS, cfg.container)
    assert "-m torch.distributed.run" in text
    assert "'/scratch/u s'\"'\"'er/proj $(x)/scripts/my train.py' --config" in text


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_gh200_preset_binds_ranks_and_sets_the_slingshot_environment(launcher, tmp_path):
    cfg = load_config("configs/tiny_wikitext.yaml", [f"launch.launcher={launcher}", "launch.env.NCCL_PROTO=Simple",
                                                     "run.name=r1"])
    assert cfg.launch.preset == "alps-gh200"  # the flagship runs on Alps
    assert cfg.slurm.cpus_per_task == (288 if launcher == "torchrun" else 72)
    text = render_sbatch(cfg, PATHS, cfg.container)
    assert_golden(f"sbatch/alps-gh200-{launcher}.sbatch", pinned_names(text))
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    # Run the script with stand-ins: what srun receives, and the environment the ranks inherit.
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\n' + SRUN_PASSING_PREFLIGHT +  # the training step's (not the plot's)
                                  'case " $* " in *" trainer.plot "*) exit 0 ;; esac\n'
                                  'printf "%s\\n" "$@" > "$RUN_DIR/srun-args"; env > "$RUN_DIR/srun-env"\n')
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho nid001\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    cfg.container.runtime = "none"
    text = render_sbatch(cfg, RunDir(run_dir, tmp_path), cfg.container)
    write_libraries(run_dir, cfg.container)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "nid001",
           "SLURM_NNODES": "2", "HOME": str(tmp_path), "RUN_DIR": str(run_dir), "SCRATCH": str(tmp_path)}
    with (tmp_path / "out").open("w") as out:
        subprocess.run(["bash", "-c", text], env=env, cwd=tmp_path, check=True, timeout=30, stdout=out, stderr=out)
    args = (run_dir / "srun-args").read_text().splitlines()
    seen = dict(line.split("=", 1) for line in (run_dir / "srun-env").read_text().splitlines() if "=" in line)
    assert seen["NCCL_NET"] == "AWS Libfabric" and seen["FI_CXI_RX_MATCH_MODE"] == "software"
    assert seen["NCCL_PROTO"] == "Simple"  # launch.env wins over the preset
    if launcher == "srun":
        assert {"--ntasks-per-node=4", "--cpus-per-task=72", "--gpus-per-task=1", "--cpu-bind=verbose,cores",
                "--mem-bind=local"} <= set(args)
    else:
        assert "--ntasks-per-node=1" in args and "--cpus-per-task=288" in args and "--numa-binding=node" in args


@pytest.mark.parametrize("overrides, field, words", [
    (["launch.preset=alps-gh200", "slurm.gpus_per_node=2", "parallel.dp=1", "parallel.tp=4", "slurm.nodes=2"],
     "launch.preset", "needs slurm.gpus_per_node and launch.procs_per_node 4"),
    (["launch.launcher=torchrun", "launch.preset=alps-gh200", "slurm.cpus_per_task=32"], "slurm.cpus_per_task",
     "must be 288, got 32"),
    (["slurm.cpus_per_task=288"], "slurm.cpus_per_task",
     "must be 72"),
    (["launch.preset=h100"], "launch.preset", "must be one of 'none', 'alps-gh200'"),
])
def test_gh200_preset_errors(overrides, field, words):
    from common.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        load_config("configs/tiny_wikitext.yaml", overrides)
    assert exc.value.field == field and words in str(exc.value), str(exc.value)
