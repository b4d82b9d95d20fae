"""The parser, `main` (the dispatch through the error edge) and the commands that read a run; those that
make runs are in jobs/cli/launch.py. `slipway cluster` parses its own arguments."""

from __future__ import annotations

import argparse
import contextlib
import functools
import re
import shlex
import sys
from pathlib import Path

from common.edge import Parser
from common.environ import as_typed
from common.errors import ConfigError, one_line
from common.secrets import mask
from jobs.cli.launch import (cluster_of, cmd_edf, cmd_local, cmd_prepare, cmd_run, cmd_shell, cmd_submit, load,
                             project_dir, rich_console)
from jobs.config import BOOL_FLAGS, CLUSTER_FLAGS, NAMED_FLAGS


def _config_args(p: argparse.ArgumentParser, optional: bool = False, cluster: bool = True, flags: bool = True) -> None:
    """CONFIG, its overrides and the named flags; `cluster=False` hides the Slurm and container flags,
    `flags=False` (`slipway image`, which reads the image section alone) has none."""
    p.add_argument("config", metavar="CONFIG", nargs="?" if optional else None,
                   help="configs/NAME.yaml, NAME, or a path")
    # default=[]: without it argparse counts the overrides among the required arguments.
    p.add_argument("overrides", nargs="*", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config value, e.g. train.steps=100 container.mounts=[/scratch]")
    if not flags:
        return
    g = p.add_argument_group("config flags (shorthands for overrides)")
    for flag, key, typ, help_ in NAMED_FLAGS + CLUSTER_FLAGS:
        shown = cluster or (flag, key, typ, help_) not in CLUSTER_FLAGS
        g.add_argument(flag, dest=f"set:{key}", type=typ, metavar=key.split(".")[-1].upper(),
                       help=f"{help_} ({key})" if shown else argparse.SUPPRESS)
    for flag, key, help_ in BOOL_FLAGS:
        g.add_argument(flag, dest=f"set:{key}", action="store_const", const=True, help=f"{help_} ({key})")
    if cluster:
        _cluster_arg(p)


def _cluster_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", metavar="NAME", help="the cluster profile to run with (clusters.yaml of the project "
                                                    "or of ~/.config/slipway; default $SLIPWAY_CLUSTER): it wins "
                                                    "over the config, overrides and flags win over it")


def cmd_doctor(args: argparse.Namespace) -> int:
    from jobs import runs
    from jobs.cli import doctor

    run_name = args.run
    if run_name and args.config:
        raise ConfigError("--run", f"give a config or --run {run_name}, not both")
    if run_name is None and args.config and not args.overrides and _names_a_run_only(args):
        run_name = args.config
    if run_name:
        return doctor.report(doctor.run_checks(runs.find_run(run_name, project_dir())), rich_console())
    cfg = load(args) if args.config else None
    profile = cfg.cluster if cfg is not None else cluster_of(args)
    return doctor.report(doctor.checks(cfg, project_dir(), profile), rich_console())


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
    from jobs.cli import status, sweep

    if args.run and (found := sweep.sweep_named(args.run, project_dir())) is not None:
        return sweep.show_sweep(project_dir(), found, rich_console())
    return status.show_status(project_dir(), args.run, console=rich_console())


def cmd_logs(args: argparse.Namespace) -> int:
    from jobs.cli import logs

    return logs.show_logs(_run(args), job_id=args.job, follow=args.follow, stream="error" if args.err else "output")


def cmd_cancel(args: argparse.Namespace) -> int:
    from jobs.cli import status, sweep

    if (found := sweep.sweep_named(args.run, project_dir())) is not None:
        return sweep.cancel_sweep(project_dir(), found, rich_console())
    return status.cancel(_run(args), console=rich_console())


def cmd_watch(args: argparse.Namespace) -> int:
    from jobs.cli import watch

    if args.interval <= 0:
        raise ConfigError("--interval", f"must be > 0 seconds, got {args.interval:g}")
    return watch.watch(_run(args), args.job, interval=args.interval, once=args.once, console=rich_console())


def cmd_nodes(args: argparse.Namespace) -> int:
    from jobs import runs
    from jobs.config import clusters
    from jobs.slurm import bad_nodes

    profile = clusters.resolve(args.cluster, project_dir())
    remembered, after = bad_nodes.bad_nodes_of(profile, runs.runs_root(project_dir()))
    return bad_nodes.show(remembered, after, args.forget or [], rich_console())


def cmd_plot(args: argparse.Namespace) -> int:
    from jobs import trainer_door
    from jobs.cli import sweep

    if (found := sweep.sweep_named(args.run, project_dir())) is not None:
        return sweep.plot_sweep(project_dir(), found, args.out)
    print(trainer_door.plot([_run(args).dir], Path(args.out) if args.out else None))
    return 0


def cmd_gpu_check(args: argparse.Namespace) -> int:
    from common.extras import require
    from jobs import gpucheck

    # What gpu-check imports here, by way of its processes: the trainer extra less datasets (the
    # shipped corpus needs none), which the wheel bundle carries (make gpu-check-wheels).
    require("gpu-check", "trainer", ("torch", "numpy", "tokenizers"), instead="on a node without network, the "
            "wheels of `make gpu-check-wheels` beside its torch (docs/trainer.md, checking a new cluster's GPU node)")
    budgets = {}
    for item in args.budget:
        part, _, seconds = item.partition("=")
        with contextlib.suppress(ValueError):
            if part in gpucheck.BUDGETS and float(seconds) > 0:
                budgets[part] = float(seconds)
                continue
        raise ConfigError("--budget", f"{item!r}: give PART=SECONDS, PART one of {', '.join(gpucheck.BUDGETS)} "
                                      "and SECONDS > 0")
    return gpucheck.gpu_check(Path(args.out), args.device, budgets, console=rich_console())


def cmd_sweep(args: argparse.Namespace) -> int:
    from jobs.cli import sweep

    return sweep.cmd_sweep(args)


def cmd_image(args: argparse.Namespace) -> int:
    from jobs.cli import image

    return image.run(args)


def cmd_compare(args: argparse.Namespace) -> int:
    from jobs.cli import sweep

    return sweep.compare(project_dir(), args.runs, args.csv, rich_console())


def _command(sub, name: str, func, help_: str, **kwargs) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_, **kwargs)
    p.set_defaults(func=func)
    return p


def _switches(p: argparse.ArgumentParser, **helps: str) -> None:
    """On/off flags, `dry_run=HELP` for --dry-run; several commands share the texts below."""
    for name, help_ in helps.items():
        p.add_argument(f"--{name.replace('_', '-')}", action="store_true", help=help_)


REPLACE = "replace an existing run's different config"
PARSABLE = "print only the job id on stdout (the rest on stderr), for scripts"
LONG_TRY = "start even when it is expected to take more than half an hour here (asked on a terminal, refused elsewhere)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="slipway",
        description="Build the training image and launch it across Slurm nodes, from one config in configs/.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _submit_commands(sub)
    _launch_commands(sub)
    _reading_commands(sub)
    parser.commands = sub.choices  # type: ignore[attr-defined]
    return parser


def _launch_commands(sub) -> None:
    """The commands that prepare, train here or give a run's environment (jobs/cli/launch.py)."""
    p = _command(sub, "prepare", cmd_prepare, "download and tokenise the config's dataset into the token cache, "
                                              "here or as a CPU job (--as-job), so no GPU allocation waits for it")
    _config_args(p)
    _switches(p, as_job="run it as a one-task CPU Slurm job (slurm.prepare_* settings), in the run's container; log "
                        "in runs/RUN/logs/")
    p.add_argument("--cpus", type=int, help="tokenizer threads here (default data.num_proc; 0: every core)")
    _switches(p, show_logs="with --as-job: follow its log until it ends", parsable=f"with --as-job: {PARSABLE}",
              force=f"with --as-job: {REPLACE}")

    p = _command(sub, "local", functools.partial(cmd_local, parse=parse),
                 "run the same launch on this machine (torchrun --standalone), no Slurm")
    _config_args(p, cluster=False)
    _switches(p, dry_run="every check of the try, its expected time and what blocks it, with the command that "
                         "clears it all; nothing written or started",
              prepare="prepare the token cache here first (slipway prepare)", force=REPLACE, yes=LONG_TRY)
    p = _command(sub, "run", cmd_run, "inside an allocation (salloc): run the batch script's steps here, rank 0's "
                                      "output on the terminal; Ctrl-C saves and stops (resumable)")
    _config_args(p, optional=True)
    _switches(p, force=REPLACE, stop_warm="stop the warm processes this allocation keeps (launch.warm) instead of "
                                          "running")

    p = _command(sub, "edf", cmd_edf, "print a config's EDF as a run would use it; --install it into EDF_PATH; "
                                      "--check or --to-pyxis a hand-written EDF")
    _config_args(p, optional=True)
    _switches(p, install="write it as NAME.toml into EDF_PATH's first directory",
              force="overwrite a different existing EDF when installing")
    p.add_argument("--check", metavar="FILE", help="read a hand-written EDF and report every problem in it")
    p.add_argument("--to-pyxis", metavar="FILE", help="print the pyxis srun flags of an EDF")

    p = _command(sub, "shell", cmd_shell, "an interactive srun --pty bash inside the image")
    _config_args(p)
    _switches(p, dry_run="print the srun command instead of running it")
    p.add_argument("--command", nargs=argparse.REMAINDER, default=None,
                   help="run this command (no --pty) instead of an interactive bash; put it last")


def _submit_commands(sub) -> None:
    p = _command(sub, "submit", cmd_submit, "write runs/RUN/ (config, EDF, sbatch, manifest) and sbatch it")
    _config_args(p)
    _switches(p, dry_run="print the script and EDF; write and submit nothing",
              show_logs="follow the job's output; exit with its exit code", force=REPLACE,
              prepare="if the token cache is not prepared, queue a CPU job that prepares it and make the training "
                      "job wait for it", parsable=PARSABLE)

    p = _command(sub, "sweep", cmd_sweep, "many runs of one config as one Slurm job array: the grid of the axes "
                                          "KEY=[V1, V2, ...] (or --points FILE); again: the points not finished",
                 description="Each point is a run (runs/SWEEP-VALUES/) that every command takes by its name. An "
                             "axis is KEY=[V1, V2, ...] on a field that is no list (a list field's axis is a list of "
                             "lists); several make their grid. Run it again to submit the points not finished, or "
                             "with more values to add points.")
    _config_args(p)
    p.add_argument("--name", help="the sweep's name (default: the config's run name); points are runs NAME-VALUES")
    p.add_argument("--points", metavar="FILE", help="a YAML list of override maps, one point each (a sweep that "
                                                   "is not a grid; crossed with the axes, if any)")
    p.add_argument("--max-parallel", type=int, metavar="K", help="at most K tasks of an array run at once (%%K)")
    _switches(p, dry_run="list the points, their resources and GPU-hours, and the arrays; write and submit nothing",
              force="replace the configs of points that changed",
              local="run the points one after another on this machine, as slipway local runs one, instead of "
                    "submitting them",
              yes="with --local: start each point even when it is expected to take more than half an hour here")

    p = _command(sub, "compare", cmd_compare, "a sweep's points (or any runs) side by side: values, final eval and "
                                              "train loss, tokens/s, MFU, steps, state; by eval loss")
    p.add_argument("runs", nargs="+", metavar="SWEEP|RUN")
    _switches(p, csv="comma-separated values, every key that differs")


def _reading_commands(sub) -> None:
    p = _command(sub, "doctor", cmd_doctor, "preflight checks before burning an allocation (with a config: of "
                                            "exactly what `submit` would get from the same arguments; with a run: "
                                            "what its next job needs)",
                 description="With CONFIG: checks what `submit` would get from the same arguments. With --run RUN, "
                             "or a bare RUN that names a run directory and no config: checks the run (its pinned "
                             "image there and as recorded, what its config builds now, its config loading, its "
                             "mount sources).")
    _config_args(p, optional=True)
    p.add_argument("--run", metavar="RUN", help="check this run (runs/RUN) instead of a config")
    p = _command(sub, "status", cmd_status, "runs and their jobs (squeue, scontrol, sacct, events.log); a sweep's "
                                            "points")
    p.add_argument("run", nargs="?", metavar="RUN|SWEEP")
    p = _command(sub, "logs", cmd_logs, "print a run's job log")
    p.add_argument("run", metavar="RUN")
    p.add_argument("-f", "--follow", action="store_true", help="follow until the job ends")
    p.add_argument("--job", help="one of the job ids `status RUN` lists, `local` too (default: the latest)")
    _switches(p, err="the error log instead of the output (a local or preparation job has one log of both)")
    p = _command(sub, "watch", cmd_watch, "a live view of a run's job (step, loss, tokens/s, MFU, ETA, time since "
                                          "the last step, per-node heartbeat and GPU use, events) until it ends; "
                                          "exits with the job's exit code")
    p.add_argument("run", metavar="RUN")
    p.add_argument("--job", help="one of the job ids `status RUN` lists (default: the run's latest training job)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    _switches(p, once="print one frame and exit 0")
    p = _command(sub, "cancel", cmd_cancel, "scancel a run's active jobs (a sweep's: every task)")
    p.add_argument("run", metavar="RUN|SWEEP")
    _image_commands(sub)
    # Listed for --help; `main` hands `slipway cluster ...` to jobs.devcluster before parsing.
    sub.add_parser("cluster", help="a real Slurm cluster on this machine to try slipway on: up | down | env | "
                                   "status (root; Debian slurm-wlm and munge)")
    p = _command(sub, "gpu-check", cmd_gpu_check, "on a GPU node, offline, in at most 10 minutes: does it train "
                                                  "correctly and fast? (the node, bf16 against fp32, slipway local "
                                                  "with an exact resume, NCCL bandwidth, tokens/s and MFU against a "
                                                  "bare loop and torchtitan), written to DIR/report.md and report.json")
    p.add_argument("--out", required=True, metavar="DIR", help="where report.md, report.json and the work go")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cuda, or cpu to check what needs no GPU with a tiny model (default: cuda where torch sees one)")
    p.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS",
                   help="a part's time budget (node 45, correctness 75, training 150, allreduce 30, speed 280)")
    p = _command(sub, "nodes", cmd_nodes, "the bad nodes a cluster remembers (blamed by a preflight, a hang or a "
                                          "node death; excluded from its later jobs): why and since when; --forget NODE")
    _cluster_arg(p)
    p.add_argument("--forget", metavar="NODE", action="append", help="forget NODE: later jobs may run on it again "
                                                                     "(repeat for more)")
    p = _command(sub, "plot", cmd_plot, "loss and throughput curves of a run as a PNG (a sweep's loss curves overlaid)")
    p.add_argument("run", metavar="RUN|SWEEP")
    p.add_argument("--out", help="PNG path (default: runs/RUN/curves.png, runs/.sweeps/SWEEP/curves.png)")


def _image_commands(sub) -> None:
    p = _command(sub, "image", cmd_image, "build / show / prune the training image (podman + enroot); see image --help",
                 description="Build and manage the training image.")
    image = p.add_subparsers(dest="action", required=True, metavar="COMMAND")
    p = image.add_parser("build", help="podman build + enroot import, unless the squashfs for this tree exists")
    _config_args(p, flags=False)
    _switches(p, no_import="stop after podman build", force="rebuild without layer cache and reimport",
              here="build on this machine even if image.build_on is compute",
              dry_run="say which steps would run (podman build, enroot import, nothing), running none")
    p.add_argument("--base-image", help="override image.base_image")
    p = image.add_parser("show", help="hash, tag, squashfs and the exact commands, running nothing")
    _config_args(p, flags=False)
    p = image.add_parser("prune", help="remove this project's old images (keeps the current one)")
    _config_args(p, optional=True, flags=False)
    p.add_argument("--keep", type=int, default=1, help="squashfs files to keep, the current one included "
                                                       "(besides those runs pin: always kept)")
    p.add_argument("--remove", action="append", metavar="SQUASHFS", default=[],
                   help="remove this image although runs pin it (their requeues then fail); repeatable")
    _switches(p, dry_run="say what would be removed and what kept, remove nothing")
    p = image.add_parser("containers", help="the unpacked pyxis containers this project's jobs keep on the nodes "
                                            "(container.keep_builds): list them, or remove them with --remove")
    _config_args(p, optional=True, flags=False)
    p.add_argument("--nodes", metavar="NODELIST", help="the nodes to look at (default: every responding node of "
                                                       "slurm.partition)")
    _switches(p, remove="remove every one that no queued or running job uses")


def main(argv: list[str] | None = None) -> int:
    from common.edge import run_at_edge

    try:
        return run_at_edge(lambda: _main(argv), handled=_tool_error)
    except KeyboardInterrupt:
        print("slipway: interrupted", file=sys.stderr)
        return 130


def _tool_error(exc: BaseException) -> int | None:
    """A Slurm command, podman or enroot that failed: its one line, exit 1 (not the user's input: exit 2)."""
    from containers.tools import ToolError
    from jobs.slurm import SlurmError

    if isinstance(exc, (SlurmError, ToolError)):
        print(f"slipway: error: {mask(one_line(as_typed(str(exc))))}", file=sys.stderr)
        return 1
    return None


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["cluster"]:
        from jobs.devcluster import main as cluster_main

        return cluster_main(argv[1:])
    args = parse(argv)
    return args.func(args)


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line `argv` (after `slipway`) as the commands take it; bad words are one line."""
    parser = build_parser()
    # Overrides may come after flags (`--nodes 2 train.steps=5`): collect the strays.
    args, extra = parser.parse_known_args(argv)
    takes = hasattr(args, "overrides")
    if takes:
        _override_form([*([args.config] if args.config else []), *args.overrides, *extra])
    strays = [e for e in extra if e.startswith("-") or "=" not in e or not takes]
    if strays:  # the help of the command given, which lists what it takes
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(strays)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    return args


_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_-]+)+")  # a dotted config key: train.steps


def _override_form(words: list[str]) -> None:
    """CONFIG, overrides and strays as typed, refused in one line naming the KEY=VALUE form where one is a
    key set another way: `train.steps 100`, `--train.steps=100`, or an override before the config."""
    flags = {key: flag for flag, key, *_ in NAMED_FLAGS + CLUSTER_FLAGS}
    for i, word in enumerate(words):
        key, sep, value = word.lstrip("-").partition("=")
        if not _KEY.fullmatch(key):
            continue
        nxt = words[i + 1] if i + 1 < len(words) else ""
        if word.startswith("-"):
            value = value or (nxt if nxt and not nxt.startswith("-") and "=" not in nxt else "VALUE")
            flag = f" (or its flag {flags[key]} {value})" if key in flags else ""
            raise ConfigError(word, f"a config key is set as KEY=VALUE, without dashes: {key}={value}{flag}")
        if i == 0 and sep:
            raise ConfigError("CONFIG", f"{shlex.quote(word)} is an override, and the config comes first: "
                                        f"CONFIG {shlex.quote(word)} (e.g. tiny_cpu {shlex.quote(word)})")
        if not sep and i > 0:
            value = nxt if nxt and "=" not in nxt and not nxt.startswith("-") else "VALUE"
            raise ConfigError(word, f"an override is KEY=VALUE in one word: {shlex.quote(f'{key}={value}')}")
