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

from kernel.environ import as_typed, invocation
from kernel.errors import ConfigError
from jobs.config import BOOL_FLAGS, CLUSTER_FLAGS, NAMED_FLAGS
from trainer.extras import require as require_extra

class Parser(argparse.ArgumentParser):
    """argparse with one-line errors, like every other slipway error."""

    def error(self, message: str):
        from kernel.errors import bounded

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


def load(args: argparse.Namespace):
    from jobs.config import load_config
    from kernel.errors import warn

    sets = {k[4:]: v for k, v in vars(args).items() if k.startswith("set:") and v is not None}
    cfg = load_config(args.config, args.overrides, sets)
    cfg.given_args = given_args(args)
    for text in cfg.launch.secret_warnings():  # the user's own lines: said once per command, not refused
        warn(text)
    return cfg


def given_args(args: argparse.Namespace) -> str:
    """The user's CONFIG, overrides and config flags as one shell-quoted string, for the commands
    a hint suggests (`slipway prepare ...`), so the suggestion pasted reads the same config."""
    argv = [args.config, *args.overrides]
    for flag, key, _, _ in NAMED_FLAGS + CLUSTER_FLAGS:
        value = getattr(args, f"set:{key}", None)
        if value is not None:
            argv += [flag, str(value)]
    argv += [flag for flag, key, _ in BOOL_FLAGS if getattr(args, f"set:{key}", None)]
    return shlex.join(argv)


def project_dir() -> Path:
    return Path(os.environ.get("SLIPWAY_PROJECT", os.getcwd())).absolute()


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(highlight=False, stderr=stderr)


# ---------------------------------------------------------------- commands


def cmd_submit(args: argparse.Namespace) -> int:
    from jobs import runs

    cfg = load(args)
    console = _console()
    if args.dry_run:
        return _dry_run(cfg, args, console)
    run, job_id, sealed, prep_id = runs.submit(cfg, project_dir(), force=args.force, prepare=args.prepare,
                                               before_writing=_check_controller)
    if args.parsable:
        print(job_id)  # nothing else on stdout: scripts read the id (notes and the summary go to stderr)
        console = _console(stderr=True)
    _notes(console, sealed.notes)
    if prep_id:
        console.print(f"data preparation job [bold]{prep_id}[/] (log {run.log_path(prep_id)}); the training job "
                      "starts once it has completed", soft_wrap=True)
    resumed = sum(1 for x in run.launches() if x.kind == "train") > 1
    console.print(f"{'resubmitted' if resumed else 'submitted'} [bold]{cfg.run.name}[/] as job [bold]{job_id}[/]"
                  f"{' (resumes from its latest checkpoint)' if resumed else ''}  run dir: {run.dir}",
                  soft_wrap=True)
    if sealed.pin.path:
        console.print(f"[dim]image {sealed.pin.path} ({sealed.pin.source}"
                      f"{', build ' + sealed.pin.build_hash[:12] if sealed.pin.build_hash else ''})[/]",
                      soft_wrap=True)
    if args.show_logs:
        console.print(f"following {run.log_path(job_id)} until the job ends (Ctrl-C stops following, "
                      "not the job)", style="dim", soft_wrap=True)
        from jobs.cli.status import follow_logs

        code = follow_logs(run, job_id, on_state=lambda s: console.print(f"[dim]job {job_id}: {s}[/]"))
        console.print(f"job {job_id} ended with exit code {code}")
        return code
    return 0


def _dry_run(cfg, args: argparse.Namespace, console) -> int:
    """`submit --dry-run`: the verdict first (what would be submitted, where, with which image and
    code, and what would refuse it), then the notes and the rendered files; nothing written."""
    from rich.markup import escape

    from jobs import runs
    from jobs.cli.doctor import controller_problem
    from kernel.secrets import mask

    sealed = runs.seal(cfg, project_dir(), dry_run=True)
    scfg, paths, pin, code = sealed.cfg, sealed.paths, sealed.pin, sealed.snapshot
    refusals = [n.removeprefix("a real submission would fail: ") for n in sealed.notes
                if n.startswith("a real submission would fail: ")]
    notes = [n for n in sealed.notes if not n.startswith("a real submission would fail: ")]
    try:
        runs.check_submittable(scfg)
        done = runs.nothing_to_train(scfg, paths.run_dir, "submit")
        why = runs.unprepared_data(sealed, cfg.config_args)
        exists = (paths.run_dir / "manifest.json").is_file()
        differs = exists and runs.config_difference(paths.config, sealed.files["config.yaml"])
        refusals += [f"train.steps: {done}"] if done else []
        refusals += [f"data: {why}"] if why and not args.prepare else []
        notes += ["the token cache is not prepared: a CPU job would prepare it first, and the training job wait "
                  "for it (--prepare)"] if why and args.prepare else []
        refusals += [f"run.name: run {scfg.run.name} exists with {differs}: pass --force to replace its config"
                     ] if differs and not args.force else []
        refusals += [problem] if (problem := controller_problem()) else []
    except ConfigError as exc:
        refusals.append(str(exc))
    s, state = scfg.slurm, ("resumes" if (paths.run_dir / "manifest.json").is_file() else "new run")
    where = (f"{s.nodes} node(s) x {scfg.launch.procs_per_node} process(es)"
             f"{f' x {s.gpus_per_node} GPU(s)' if s.gpus_per_node else ''}, time {s.time}"
             + "".join(f", {k} {v}" for k, v in (("partition", s.partition), ("account", s.account)) if v)
             + f"; runtime {scfg.container.runtime}, launcher {scfg.launch.launcher}")
    built = f"build {pin.build_hash[:12]}" if pin.build_hash else "not built yet" if pin.source == "none" else pin.source
    image = f"{pin.image} ({built})" if pin.image else "none: this environment's Python on the nodes"
    source = (f"git {code.commit[:12]}{' with uncommitted changes' if code.dirty else ''}" if code and code.commit
              else "not a git checkout")
    code_line = (f"a snapshot of this checkout ({source}; {code.files} files, {code.hash12})" if code
                 else "the image's own (code.snapshot: false)")
    verdict = "[green]would be submitted[/]" if not refusals else f"[red]would be refused[/] ({len(refusals)})"
    for label, text in (("dry run", f"{escape(scfg.run.name)} ({state}) in {escape(str(paths.run_dir))}: nothing "
                                    "written, nothing submitted"),
                        ("where", escape(where)), ("image", escape(image)), ("code", escape(code_line)),
                        ("verdict", verdict)):
        console.print(f"[bold]{label}:[/] {text}", soft_wrap=True, highlight=False)
    for refusal in refusals:
        console.print(f"  - {escape(mask(as_typed(refusal)))}", soft_wrap=True, highlight=False)
    _notes(console, notes)
    for name in ("job.sbatch", "env.toml"):
        if name in sealed.files:
            print(f"==> {paths.run_dir / name} <==", flush=True)
            sys.stdout.write(mask(sealed.files[name]))  # launch.pre_launch is the user's own text
            sys.stdout.flush()
    console.print(f"[bold]dry run:[/] nothing written, nothing submitted; {verdict}"
                  f"{' (the reasons are at the top)' if refusals else ''}", soft_wrap=True)
    return 0


def _check_controller() -> None:
    """Once the input is checked and before anything is written: a submission no controller
    would take fails with doctor's one-line diagnosis, not sbatch's resolver errors."""
    from jobs.cli.doctor import controller_problem
    from jobs.slurm import SlurmError

    problem = controller_problem()
    if problem:
        raise SlurmError(problem)


def _notes(console, notes: list[str]) -> None:
    from rich.markup import escape

    from kernel.secrets import mask

    for note in notes:  # a note quotes paths and overrides (`container.mounts=[...]`): never markup
        console.print(f"[yellow]note:[/] {escape(mask(as_typed(note)))}", soft_wrap=True, markup=True, highlight=False)


def cmd_prepare(args: argparse.Namespace) -> int:
    from jobs import runs

    cfg = load(args)
    console = _console()
    if args.as_job:
        run, job_id, sealed = runs.submit_prepare(cfg, project_dir(), force=args.force)
        if args.parsable:
            print(job_id)  # nothing else on stdout: scripts read the id (the rest goes to stderr)
            console = _console(stderr=True)
        _notes(console, sealed.notes)
        console.print(f"submitted the data preparation of [bold]{cfg.run.name}[/] as job [bold]{job_id}[/] "
                      f"(log {run.log_path(job_id)}); `{invocation()} submit {cfg.config_args}` once it has completed, "
                      "or now with --prepare to queue it behind", soft_wrap=True)
        if args.show_logs:
            from jobs.cli.status import follow_logs

            return follow_logs(run, job_id, on_state=lambda s: console.print(f"[dim]job {job_id}: {s}[/]"))
        return 0
    require_extra("prepare", "trainer", ("numpy", "tokenizers", "datasets"),
                  instead=f"prepare in the image as a CPU job: slipway prepare {cfg.config_args} --as-job")
    sealed = runs.seal(cfg, project_dir(), dry_run=True)
    data = sealed.cfg.data
    # Hub downloads land where the job's own HF_HOME is (set before the hub libraries load).
    if cfg.launch.hf_home:
        from edf import expand_host

        os.environ["HF_HOME"] = expand_host(cfg.launch.hf_home, "launch.hf_home")
    else:
        os.environ.setdefault("HF_HOME", str(sealed.paths.project_dir / ".cache" / "huggingface"))
    from trainer.prepare import DataCacheError, prepare

    console.print(f"preparing {data.dataset} with tokenizer {data.tokenizer} into {data.cache_dir}", soft_wrap=True)
    try:
        result = prepare(data, data.cache_dir, num_proc=data.num_proc if args.cpus is None else args.cpus,
                         progress=console)
    except DataCacheError as exc:
        raise ConfigError("data.cache_dir", str(exc)) from None
    for entry in result.entries:
        console.print(entry.describe(), soft_wrap=True, highlight=False)
    console.print(f"[green]prepared[/]: `{invocation()} submit {cfg.config_args}` will only open this cache",
                  soft_wrap=True)
    return 0


def cmd_local(args: argparse.Namespace) -> int:
    from jobs import local

    cfg = load(args)
    require_extra("local", "trainer")
    named = getattr(args, "set:run.name") is not None or any(o.startswith("run.name=") for o in args.overrides)
    return local.run_local(cfg, project_dir(), force=args.force, console=_console(), rename=not named)


def cmd_run(args: argparse.Namespace) -> int:
    from jobs import local

    return local.run_in_allocation(load(args), project_dir(), force=args.force, console=_console())


def cmd_edf(args: argparse.Namespace) -> int:
    from edf import check_edf, install_edf, parse_edf, render_edf, srun_flags
    from kernel.secrets import mask

    if args.check or args.to_pyxis:
        path = Path(args.check or args.to_pyxis)
        notes: list[str] = []
        # --check also looks for the image file and mount sources; --to-pyxis may run elsewhere.
        env, problems = check_edf(path, notes=notes if args.check else None)
        for note in notes:
            print(f"note: {mask(note)}", file=sys.stderr)
        for problem in problems:
            print(f"slipway: error: {problem}", file=sys.stderr)
        if problems:
            print(f"{path}: {len(problems)} problem(s)", file=sys.stderr)
            return 2
        if args.check:
            print(f"{path}: ok" + (f" ({len(notes)} path(s) not judged, see the notes)" if notes else ""))
            return 0
        env = parse_edf(path)
        env.runtime = "pyxis"
        flags = srun_flags(env)
        for warning in flags.warnings:
            print(f"note: {mask(warning)}", file=sys.stderr)
        from jobs.slurm.script import shell_value

        # a hand-written EDF's values, printed: what looks like a secret is hidden (check_edf warned)
        for name, value in flags.exports:
            print(mask(f"export {name}={shell_value(value)}"))
        print(mask(" ".join(shell_value(a) for a in flags.args)))
        return 0
    if args.config is None:
        raise ConfigError("CONFIG", "give a config (slipway edf CONFIG), or --check FILE / --to-pyxis FILE")
    from jobs import runs

    cfg = load(args)
    if not cfg.container.in_container:
        raise ConfigError("container.runtime", "runtime none has no container environment: set "
                                               "container.runtime to edf or pyxis")
    # The environment alone: an EDF kept in EDF_PATH outlives any one launch, and a run's code
    # snapshot comes with each launch (submit, run), not with the environment.
    cfg.code.snapshot = False
    sealed = runs.seal(cfg, project_dir(), dry_run=not args.install)
    _notes(_console(), sealed.notes)
    if args.install:
        print(install_edf(sealed.env, cfg.container.edf_name or cfg.run.name, force=args.force))
    else:
        sys.stdout.write(mask(render_edf(sealed.env)))
    return 0


def cmd_shell(args: argparse.Namespace) -> int:
    from jobs import local
    from kernel.secrets import mask

    cfg = load(args)
    if args.dry_run:
        text, notes = local.shell_dry_run(cfg, project_dir(), command=args.command)
        for note in notes:
            print(f"note: {mask(note)}", file=sys.stderr)
        sys.stdout.write(mask(text))  # --command is the user's own text
        return 0
    return local.run_shell(cfg, project_dir(), command=args.command)


def cmd_doctor(args: argparse.Namespace) -> int:
    from jobs import runs
    from jobs.cli import doctor

    run_name = args.run
    if run_name and args.config:
        raise ConfigError("--run", f"give a config or --run {run_name}, not both")
    if run_name is None and args.config and not args.overrides and _names_a_run_only(args):
        run_name = args.config
    if run_name:
        return doctor.run_doctor_run(runs.find_run(run_name, project_dir()), console=_console())
    cfg = load(args) if args.config else None
    return doctor.run_doctor(cfg, project_dir(), console=_console())


def _names_a_run_only(args: argparse.Namespace) -> bool:
    """`slipway doctor NAME`: NAME is a run when it names no config but a run directory (a
    config wins a tie: `--run NAME` asks for the run)."""
    from jobs.config import resolve_config_path
    from jobs.runs import runs_root
    from jobs.runs.manifest import MANIFEST

    if any(k.startswith("set:") and v is not None for k, v in vars(args).items()):
        return False
    try:
        resolve_config_path(args.config)
        return False
    except ConfigError:
        return "/" not in args.config and (runs_root(project_dir()) / args.config / MANIFEST).is_file()


def cmd_status(args: argparse.Namespace) -> int:
    from jobs.cli import status

    return status.show_status(project_dir(), args.run, console=_console())


def cmd_logs(args: argparse.Namespace) -> int:
    from jobs import runs
    from jobs.cli import status

    run = runs.find_run(args.run, project_dir())
    return status.show_logs(run, job_id=args.job, follow=args.follow, stream="error" if args.err else "output")


def cmd_cancel(args: argparse.Namespace) -> int:
    from jobs import runs
    from jobs.cli import status

    run = runs.find_run(args.run, project_dir())
    return status.cancel(run, console=_console())


def cmd_watch(args: argparse.Namespace) -> int:
    from jobs import runs
    from jobs.cli import watch

    if args.interval <= 0:
        raise ConfigError("--interval", f"must be > 0 seconds, got {args.interval:g}")
    run = runs.find_run(args.run, project_dir())
    return watch.watch(run, args.job, interval=args.interval, once=args.once, console=_console())


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
    _config_args(p)
    p.add_argument("--force", action="store_true", help="replace an existing run's different config")
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
    # `slipway cluster ...` to jobs.cluster before parsing.
    sub.add_parser("image", help="build / show / prune the training image (podman + enroot); see image --help")
    sub.add_parser("cluster", help="a real Slurm cluster on this machine to try slipway on: up | down | env | "
                                   "status (root; Debian slurm-wlm and munge)")

    p = sub.add_parser("plot", help="loss and throughput curves of a run as a PNG")
    p.add_argument("run", metavar="RUN")
    p.add_argument("--out", help="PNG path (default: runs/RUN/curves.png)")
    p.set_defaults(func=cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    from kernel.edge import run_at_edge

    try:
        return run_at_edge(lambda: _main(argv), handled=_slurm_error)
    except KeyboardInterrupt:
        print("slipway: interrupted", file=sys.stderr)
        return 130


def _slurm_error(exc: BaseException) -> int | None:
    """A Slurm command that failed: its one line, exit 1 (not the user's input: exit 2)."""
    from jobs.slurm import SlurmError

    if isinstance(exc, SlurmError):
        from kernel.secrets import mask

        print(f"slipway: error: {mask(as_typed(str(exc)))}", file=sys.stderr)
        return 1
    return None


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["image"]:  # the image commands parse their own arguments
        from jobs.cli.image import main as image_main

        return image_main(argv[1:])
    if argv[:1] == ["cluster"]:
        from jobs.cluster import main as cluster_main

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
