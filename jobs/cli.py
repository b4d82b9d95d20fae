"""`slipway` (= `python -m jobs`): the command line on the login node.

Parses arguments, loads the one config tree, and hands it to the module that
does the work. Errors in what the user gave print one line and exit 2.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

from trainer.config import ConfigError

# The seed launcher's named flags: (flag, dotted config key, type, help).
NAMED_FLAGS: list[tuple[str, str, Callable[[str], Any], str]] = [
    ("--run-name", "run.name", str, "run name: the run directory runs/NAME and the Slurm job name"),
    ("--project", "run.project", str, "project name for logging (W&B)"),
    ("--seed", "run.seed", int, "random seed"),
    ("--nodes", "slurm.nodes", int, "number of nodes"),
    ("--gpus-per-node", "slurm.gpus_per_node", int, "GPUs per node (0 for CPU runs)"),
    ("--procs-per-node", "launch.procs_per_node", int, "processes per node (default: gpus per node)"),
    ("--cpus-per-task", "slurm.cpus_per_task", int, "CPUs per Slurm task"),
    ("--partition", "slurm.partition", str, "Slurm partition"),
    ("--account", "slurm.account", str, "Slurm account"),
    ("--qos", "slurm.qos", str, "Slurm QOS"),
    ("--time", "slurm.time", str, "time limit, HH:MM:SS"),
    ("--email", "slurm.email", str, "mail on job end or failure"),
    ("--runtime", "container.runtime", str, "edf | pyxis | none"),
    ("--image", "container.image", str, "squashfs path (absolute or ./) or registry reference"),
    ("--launcher", "launch.launcher", str, "torchrun (one task per node) | srun (one task per process)"),
    ("--model-size", "model.size", str, "tiny | small | base | large | custom"),
    ("--hidden-size", "model.hidden_size", int, "model hidden size"),
    ("--intermediate-size", "model.intermediate_size", int, "MLP intermediate size"),
    ("--num-layers", "model.num_layers", int, "number of layers"),
    ("--num-heads", "model.num_heads", int, "attention heads"),
    ("--num-kv-heads", "model.num_kv_heads", int, "key/value heads (grouped-query attention)"),
    ("--dp", "parallel.dp", int, "data-parallel degree"),
    ("--tp", "parallel.tp", int, "tensor-parallel degree"),
    ("--pp", "parallel.pp", int, "pipeline-parallel degree"),
    ("--train-steps", "train.steps", int, "training steps"),
    ("--micro-batch-size", "train.micro_batch_size", int, "sequences per micro batch per data-parallel rank"),
    ("--grad-accum-steps", "train.grad_accum_steps", int, "micro batches per step"),
    ("--learning-rate", "train.lr", float, "peak learning rate"),
    ("--min-lr", "train.min_lr", float, "learning rate at the end of the decay"),
    ("--warmup-steps", "train.warmup_steps", int, "linear warmup steps"),
    ("--weight-decay", "train.weight_decay", float, "AdamW weight decay"),
    ("--grad-clip", "train.grad_clip", float, "gradient clipping by global norm (0: off)"),
    ("--train-script", "train.script", str, "a custom training script run instead of the built-in trainer"),
    ("--dataset", "data.dataset", str, "Hugging Face dataset name or local path"),
    ("--tokenizer", "data.tokenizer", str, "tokenizer name or local path"),
    ("--text-column", "data.text_column", str, "text column of the dataset"),
    ("--seq-len", "data.seq_len", int, "sequence length"),
    ("--save-interval", "checkpoint.interval", int, "checkpoint every N steps"),
]
BOOL_FLAGS = [
    ("--save-initial-state", "checkpoint.save_initial", "save a checkpoint before the first step"),
    ("--debug", "launch.debug", "debug mode: set -x, CUDA_LAUNCH_BLOCKING, NCCL_DEBUG=INFO"),
    ("--wandb", "logging.wandb", "log to Weights & Biases (offline unless WANDB_API_KEY is set)"),
]


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors, like every other slipway error."""

    def error(self, message: str):
        self.exit(2, f"slipway: error: {message} (see `{self.prog} --help`)\n")


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG", help="configs/NAME.yaml, NAME, or a path")
    p.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE",
                   help="override any config value, e.g. train.steps=100 container.mounts=[/scratch]")
    g = p.add_argument_group("config flags (shorthands for overrides)")
    for flag, key, typ, help_ in NAMED_FLAGS:
        g.add_argument(flag, dest=f"set:{key}", type=typ, metavar=key.split(".")[-1].upper(), help=f"{help_} ({key})")
    for flag, key, help_ in BOOL_FLAGS:
        g.add_argument(flag, dest=f"set:{key}", action="store_const", const=True, help=f"{help_} ({key})")


def load(args: argparse.Namespace):
    from jobs.config import load_config

    sets = {k[4:]: v for k, v in vars(args).items() if k.startswith("set:") and v is not None}
    return load_config(args.config, args.overrides, sets)


def project_dir() -> Path:
    return Path(os.environ.get("SLIPWAY_PROJECT", os.getcwd())).absolute()


def _console():
    from rich.console import Console

    return Console(highlight=False)


# ---------------------------------------------------------------- commands


def cmd_submit(args: argparse.Namespace) -> int:
    from jobs import runs

    cfg = load(args)
    console = _console()
    if args.dry_run:
        run_paths = runs.RunPaths(runs.runs_root(project_dir()) / cfg.run.name, project_dir())
        files = runs.render_run_files(cfg, run_paths)
        for name in ("job.sbatch", "env.toml"):
            if name in files:
                console.rule(f"[bold]{run_paths.run_dir / name}")
                sys.stdout.write(files[name])
                sys.stdout.flush()
        try:
            runs.check_submittable(cfg)
        except ConfigError as exc:
            console.print(f"[yellow]warning:[/] a real submission would fail: {exc}")
        console.print(f"[bold]dry run:[/] nothing written, nothing submitted ({cfg.run.name}, "
                      f"{cfg.slurm.nodes} node(s) x {cfg.launch.procs_per_node} process(es), "
                      f"runtime {cfg.container.runtime}, launcher {cfg.launch.launcher})")
        return 0
    run, job_id = runs.submit(cfg, project_dir(), force=args.force)
    resumed = len(run.job_ids()) > 1
    console.print(f"{'resubmitted' if resumed else 'submitted'} [bold]{cfg.run.name}[/] as job [bold]{job_id}[/]"
                  f"{' (resumes from its latest checkpoint)' if resumed else ''}  run dir: {run.dir}",
                  soft_wrap=True)
    print(job_id)
    if args.show_logs:
        console.print(f"following {run.log_path(job_id)} until the job ends (Ctrl-C stops following, "
                      "not the job)", style="dim", soft_wrap=True)
        code = runs.follow(run, job_id, on_state=lambda s: console.print(f"[dim]job {job_id}: {s}[/]"))
        console.print(f"job {job_id} ended with exit code {code}")
        return code
    return 0


def cmd_local(args: argparse.Namespace) -> int:
    from jobs import local

    cfg = load(args)
    named = getattr(args, "set:run.name") is not None or any(o.startswith("run.name=") for o in args.overrides)
    return local.run_local(cfg, project_dir(), force=args.force, console=_console(), rename=not named)


def cmd_edf(args: argparse.Namespace) -> int:
    from edf import Environment, install_edf, write_edf
    from jobs import runs

    cfg = load(args)
    if cfg.container.runtime == "none":
        raise ConfigError("container.runtime", "runtime none has no container environment: set "
                                               "container.runtime to edf or pyxis")
    env = Environment.from_container(cfg.container)
    target = runs.runs_root(project_dir()) / cfg.run.name / "env.toml"
    write_edf(env, target, force=True if not target.exists() else args.force)
    print(target)
    if args.install:
        print(install_edf(env, cfg.container.edf_name or cfg.run.name, force=args.force))
    return 0


def cmd_shell(args: argparse.Namespace) -> int:
    from jobs import local

    cfg = load(args)
    argv = local.shell_argv(cfg, project_dir(), command=args.command)
    if args.dry_run:
        print(shlex.join(argv))
        return 0
    return local.exec_foreground(argv)


def cmd_doctor(args: argparse.Namespace) -> int:
    from jobs import doctor

    cfg = load(args) if args.config else None
    return doctor.run_doctor(cfg, project_dir(), console=_console())


def cmd_status(args: argparse.Namespace) -> int:
    from jobs import status

    return status.show_status(project_dir(), args.run, console=_console())


def cmd_logs(args: argparse.Namespace) -> int:
    from jobs import runs, status

    run = runs.find_run(args.run, project_dir())
    return status.show_logs(run, job_id=args.job, follow=args.follow, stream="error" if args.err else "output")


def cmd_cancel(args: argparse.Namespace) -> int:
    from jobs import runs, status

    run = runs.find_run(args.run, project_dir())
    return status.cancel(run, console=_console())


def cmd_plot(args: argparse.Namespace) -> int:
    from jobs import runs
    from trainer.plot import plot_run

    run = runs.find_run(args.run, project_dir())
    out = plot_run(run.dir, Path(args.out) if args.out else None)
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="slipway",
        description="Build the training image and launch it across Slurm nodes, from one config in configs/.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("submit", help="write runs/RUN/ (config, EDF, sbatch, manifest) and sbatch it")
    _config_args(p)
    p.add_argument("--dry-run", action="store_true", help="print the script and EDF; write and submit nothing")
    p.add_argument("--show-logs", action="store_true", help="follow the job's output; exit with its exit code")
    p.add_argument("--force", action="store_true", help="replace an existing run's different config")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("local", help="run the same launch on this machine (torchrun --standalone), no Slurm")
    _config_args(p)
    p.add_argument("--force", action="store_true", help="replace an existing run's different config")
    p.set_defaults(func=cmd_local)

    p = sub.add_parser("edf", help="write the EDF (runs/RUN/env.toml; --install: into EDF_PATH)")
    _config_args(p)
    p.add_argument("--install", action="store_true", help="also install NAME.toml into EDF_PATH's first directory")
    p.add_argument("--force", action="store_true", help="overwrite a different existing EDF")
    p.set_defaults(func=cmd_edf)

    p = sub.add_parser("shell", help="an interactive srun --pty bash inside the image")
    _config_args(p)
    p.add_argument("--dry-run", action="store_true", help="print the srun command instead of running it")
    p.add_argument("--command", nargs=argparse.REMAINDER, default=None,
                   help="run this command (no --pty) instead of an interactive bash; put it last")
    p.set_defaults(func=cmd_shell)

    p = sub.add_parser("doctor", help="preflight checks before burning an allocation")
    p.add_argument("config", nargs="?", metavar="CONFIG")
    p.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("status", help="runs and their jobs (squeue, scontrol, sacct, events.log)")
    p.add_argument("run", nargs="?", metavar="RUN")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("logs", help="print a run's job log")
    p.add_argument("run", metavar="RUN")
    p.add_argument("-f", "--follow", action="store_true", help="follow until the job ends")
    p.add_argument("--job", help="job id (default: the latest)")
    p.add_argument("--err", action="store_true", help="the error log instead of the output")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("cancel", help="scancel a run's active jobs")
    p.add_argument("run", metavar="RUN")
    p.set_defaults(func=cmd_cancel)

    # Listed for --help; `main` hands `slipway image ...` to `python -m containers` before parsing.
    sub.add_parser("image", help="build / show / prune the training image (podman + enroot); see image --help")

    p = sub.add_parser("plot", help="loss and throughput curves of a run as a PNG")
    p.add_argument("run", metavar="RUN")
    p.add_argument("--out", help="PNG path (default: runs/RUN/curves.png)")
    p.set_defaults(func=cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["image"]:  # the image commands parse their own arguments (python -m containers)
        from containers.__main__ import main as containers_main

        return containers_main(argv[1:])
    parser = build_parser()
    # Overrides may come after flags (`--nodes 2 train.steps=5`): collect the strays.
    args, extra = parser.parse_known_args(argv)
    strays = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if strays:
        parser.error(f"unrecognized arguments: {' '.join(strays)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    if getattr(args, "config", None) is None and args.command == "doctor":
        args.overrides = []
    from jobs.slurm import SlurmError

    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"slipway: error: {exc}", file=sys.stderr)
        return 2
    except SlurmError as exc:
        print(f"slipway: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("slipway: interrupted", file=sys.stderr)
        return 130
