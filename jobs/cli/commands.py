"""The parser, `main` (the dispatch through the error edge) and the commands that read a
run: doctor, status, logs, watch, cancel, plot. The commands that make runs are in
jobs/cli/launch.py; `slipway image` and `slipway cluster` parse their own arguments."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.environ import as_typed
from common.errors import ConfigError, bounded
from jobs.cli.launch import (cmd_edf, cmd_local, cmd_prepare, cmd_run, cmd_shell, cmd_submit, load, project_dir,
                             rich_console)
from jobs.config import BOOL_FLAGS, CLUSTER_FLAGS, NAMED_FLAGS


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors, like every other slipway error."""

    def error(self, message: str):
        # argparse quotes what it could not read (`invalid int value: '999...'`): bounded, one line,
        # masked by the secret policy.
        message = " ".join(bounded(message, 300).split())
        self.exit(2, f"slipway: error: {message} (see `{self.prog} --help`)\n")


def _config_args(p: argparse.ArgumentParser, optional: bool = False, cluster: bool = True) -> None:
    """CONFIG, its overrides and the named flags; `cluster=False` hides the Slurm and container flags."""
    p.add_argument("config", metavar="CONFIG", nargs="?" if optional else None,
                   help="configs/NAME.yaml, NAME, or a path")
    p.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE",
                   help="override any config value, e.g. train.steps=100 container.mounts=[/scratch]")
    g = p.add_argument_group("config flags (shorthands for overrides)")
    for flag, key, typ, help_ in NAMED_FLAGS + CLUSTER_FLAGS:
        shown = cluster or (flag, key, typ, help_) not in CLUSTER_FLAGS
        g.add_argument(flag, dest=f"set:{key}", type=typ, metavar=key.split(".")[-1].upper(),
                       help=f"{help_} ({key})" if shown else argparse.SUPPRESS)
    for flag, key, help_ in BOOL_FLAGS:
        g.add_argument(flag, dest=f"set:{key}", action="store_const", const=True, help=f"{help_} ({key})")


def cmd_doctor(args: argparse.Namespace) -> int:
    from jobs import runs
    from jobs.cli import doctor

    run_name = args.run
    if run_name and args.config:
        raise ConfigError("--run", f"give a config or --run {run_name}, not both")
    if run_name is None and args.config and not args.overrides and _names_a_run_only(args):
        run_name = args.config
    if run_name:
        return doctor.run_doctor_run(runs.find_run(run_name, project_dir()), console=rich_console())
    cfg = load(args) if args.config else None
    return doctor.run_doctor(cfg, project_dir(), console=rich_console())


def _names_a_run_only(args: argparse.Namespace) -> bool:
    """`slipway doctor NAME`: NAME is a run when it names no config but a run directory (a
    config wins a tie: `--run NAME` asks for the run)."""
    from jobs.config import resolve_config_path
    from jobs.runs import runs_root
    from common.rundir import RunDir

    if any(k.startswith("set:") and v is not None for k, v in vars(args).items()):
        return False
    try:
        resolve_config_path(args.config)
        return False
    except ConfigError:
        return "/" not in args.config and RunDir(runs_root(project_dir()) / args.config).manifest.is_file()


def _run(args: argparse.Namespace):
    from jobs import runs

    return runs.find_run(args.run, project_dir())


def cmd_status(args: argparse.Namespace) -> int:
    from jobs.cli import status

    return status.show_status(project_dir(), args.run, console=rich_console())


def cmd_logs(args: argparse.Namespace) -> int:
    from jobs.cli import status

    return status.show_logs(_run(args), job_id=args.job, follow=args.follow, stream="error" if args.err else "output")


def cmd_cancel(args: argparse.Namespace) -> int:
    from jobs.cli import status

    return status.cancel(_run(args), console=rich_console())


def cmd_watch(args: argparse.Namespace) -> int:
    from jobs.cli import watch

    if args.interval <= 0:
        raise ConfigError("--interval", f"must be > 0 seconds, got {args.interval:g}")
    return watch.watch(_run(args), args.job, interval=args.interval, once=args.once, console=rich_console())


def cmd_plot(args: argparse.Namespace) -> int:
    from jobs import trainer_door

    print(trainer_door.plot([_run(args).dir], Path(args.out) if args.out else None))
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
    p.add_argument("--prepare", action="store_true", help="if the token cache is not prepared, queue a CPU job that "
                                                         "prepares it and make the training job wait for it")
    p.add_argument("--parsable", action="store_true", help="print only the job id on stdout (the rest on stderr), "
                                                          "for scripts")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("prepare", help="download and tokenise the config's dataset into the token cache, here or "
                                       "as a CPU job (--as-job), so no GPU allocation waits for it")
    _config_args(p)
    p.add_argument("--as-job", action="store_true", help="run it as a one-task CPU Slurm job (slurm.prepare_* "
                                                        "settings), in the run's container; log in runs/RUN/logs/")
    p.add_argument("--cpus", type=int, help="tokenizer threads here (default data.num_proc; 0: every core)")
    p.add_argument("--show-logs", action="store_true", help="with --as-job: follow its log until it ends")
    p.add_argument("--parsable", action="store_true", help="with --as-job: print only the job id on stdout (the rest "
                                                          "on stderr), for scripts")
    p.add_argument("--force", action="store_true", help="with --as-job: replace an existing run's different config")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("local", help="run the same launch on this machine (torchrun --standalone), no Slurm")
    _config_args(p, cluster=False)
    p.add_argument("--force", action="store_true", help="replace an existing run's different config")
    p.set_defaults(func=cmd_local)

    p = sub.add_parser("run", help="inside an allocation (salloc): run the batch script's steps here, rank 0's "
                                   "output on the terminal; Ctrl-C saves and stops (resumable)")
    _config_args(p, optional=True)
    p.add_argument("--force", action="store_true", help="replace an existing run's different config")
    p.add_argument("--stop-warm", action="store_true", help="stop the warm processes this allocation keeps "
                                                           "(launch.warm) instead of running")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("edf", help="print a config's EDF as a run would use it; --install it into EDF_PATH; "
                                   "--check or --to-pyxis a hand-written EDF")
    _config_args(p, optional=True)
    p.add_argument("--install", action="store_true", help="write it as NAME.toml into EDF_PATH's first directory")
    p.add_argument("--force", action="store_true", help="overwrite a different existing EDF when installing")
    p.add_argument("--check", metavar="FILE", help="read a hand-written EDF and report every problem in it")
    p.add_argument("--to-pyxis", metavar="FILE", help="print the pyxis srun flags of an EDF")
    p.set_defaults(func=cmd_edf)

    p = sub.add_parser("shell", help="an interactive srun --pty bash inside the image")
    _config_args(p)
    p.add_argument("--dry-run", action="store_true", help="print the srun command instead of running it")
    p.add_argument("--command", nargs=argparse.REMAINDER, default=None,
                   help="run this command (no --pty) instead of an interactive bash; put it last")
    p.set_defaults(func=cmd_shell)

    p = sub.add_parser("doctor", help="preflight checks before burning an allocation (with a config: of exactly "
                                      "what `submit` would get from the same arguments; with a run: what its "
                                      "next job needs)",
                       description="With CONFIG: checks what `submit` would get from the same arguments. With "
                                   "--run RUN, or a bare RUN that names a run directory and no config: checks "
                                   "the run (its pinned image there and as recorded, what its config builds "
                                   "now, its config loading, its mount sources).")
    _config_args(p, optional=True)
    p.add_argument("--run", metavar="RUN", help="check this run (runs/RUN) instead of a config")
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

    p = sub.add_parser("watch", help="a live view of a run's job (step, loss, tokens/s, MFU, ETA, time since the "
                                     "last step, per-node heartbeat and GPU use, events) until it ends; exits "
                                     "with the job's exit code")
    p.add_argument("run", metavar="RUN")
    p.add_argument("--job", help="job id (default: the run's latest training job)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--once", action="store_true", help="print one frame and exit 0")
    p.set_defaults(func=cmd_watch)

    p = sub.add_parser("cancel", help="scancel a run's active jobs")
    p.add_argument("run", metavar="RUN")
    p.set_defaults(func=cmd_cancel)

    # Listed for --help; `main` hands `slipway image ...` to jobs.cli.image and
    # `slipway cluster ...` to jobs.devcluster before parsing.
    sub.add_parser("image", help="build / show / prune the training image (podman + enroot); see image --help")
    sub.add_parser("cluster", help="a real Slurm cluster on this machine to try slipway on: up | down | env | "
                                   "status (root; Debian slurm-wlm and munge)")

    p = sub.add_parser("plot", help="loss and throughput curves of a run as a PNG")
    p.add_argument("run", metavar="RUN")
    p.add_argument("--out", help="PNG path (default: runs/RUN/curves.png)")
    p.set_defaults(func=cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    from common.edge import run_at_edge

    try:
        return run_at_edge(lambda: _main(argv), handled=_slurm_error)
    except KeyboardInterrupt:
        print("slipway: interrupted", file=sys.stderr)
        return 130


def _slurm_error(exc: BaseException) -> int | None:
    """A Slurm command that failed: its one line, exit 1 (not the user's input: exit 2)."""
    from jobs.slurm import SlurmError

    if isinstance(exc, SlurmError):
        from common.secrets import mask

        print(f"slipway: error: {mask(as_typed(str(exc)))}", file=sys.stderr)
        return 1
    return None


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["image"]:  # the image commands parse their own arguments
        from jobs.cli.image import main as image_main

        return image_main(argv[1:])
    if argv[:1] == ["cluster"]:
        from jobs.devcluster import main as cluster_main

        return cluster_main(argv[1:])
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
    return args.func(args)
