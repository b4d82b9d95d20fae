"""The commands that make a run (submit, prepare, local, run, edf, shell), and what every command
shares: the project directory, the config from CONFIG, its overrides and flags, and the terminal."""

from __future__ import annotations

import argparse
import functools
import shlex
import sys
from pathlib import Path

from common import environ
from common.environ import as_typed, invocation, project_dir
from common.errors import ConfigError, one_line
from common.secrets import mask
from jobs.config import BOOL_FLAGS, CLUSTER_FLAGS, NAMED_FLAGS
from common.extras import EXTRAS, require as require_extra

REFUSED = "a real submission would fail: "  # how runs.seal marks a dry run's note that is a refusal


def rich_console(stderr: bool = False):
    from rich.console import Console

    return Console(highlight=False, stderr=stderr)


def load(args: argparse.Namespace, quiet: bool = False):
    """The config, keeping its arguments shell-quoted for the commands a hint suggests (`slipway prepare
    ...`) to read the same config. `quiet`: no warnings (a command line loaded to check a suggestion)."""
    from jobs.config import load_config
    from common.errors import warn

    sets, given = config_sets(args)
    cfg = load_config(args.config, args.overrides, sets, cluster=cluster_of(args))
    cfg.given_args = given
    if not quiet:  # a suggestion's CONFIG, wherever its text comes from, is what the user gave
        environ.given_config(cfg.config_args)
    for text in [] if quiet else cfg.launch.secret_warnings():  # the user's own lines: said once, not refused
        warn(text)
    return cfg


def cluster_of(args: argparse.Namespace):
    """The cluster profile a command that takes --cluster runs on (jobs/config/clusters.py `resolve`), else None."""
    from jobs.config import clusters

    return clusters.resolve(args.cluster, project_dir()) if hasattr(args, "cluster") else None


def config_sets(args: argparse.Namespace) -> tuple[dict, str]:
    """The config flags given (dotted key -> value) and the command's config arguments, shell-quoted."""
    sets = {k[4:]: v for k, v in vars(args).items() if k.startswith("set:") and v is not None}
    given_cluster = getattr(args, "cluster", None)
    given, switches = [args.config, *args.overrides], {key for _, key, _ in BOOL_FLAGS}
    given += ["--cluster", given_cluster] if given_cluster else []
    for flag, key, *_ in NAMED_FLAGS + CLUSTER_FLAGS + BOOL_FLAGS:
        if key in sets:
            given += [flag] if key in switches else [flag, str(sets[key])]
    return sets, shlex.join(given)


def print_notes(console, notes: list[str]) -> None:
    from rich.markup import escape

    for note in notes:  # a note quotes paths and overrides (`container.mounts=[...]`): never markup
        console.print(f"[yellow]note:[/] {escape(mask(one_line(as_typed(note))))}", soft_wrap=True, markup=True,
                      highlight=False)


def _submitted(args: argparse.Namespace, job_id: str, notes: list[str]):
    """The console for what follows a submission: with --parsable the job id alone goes to stdout."""
    if args.parsable:
        print(job_id)
    console = rich_console(stderr=args.parsable)
    print_notes(console, notes)
    return console


def _follow(console, run, job_id: str) -> int:
    from jobs.cli.logs import follow_logs

    return follow_logs(run, job_id, on_state=lambda s: console.print(f"[dim]job {job_id}: {_plain(s)}[/]"))


def _plain(value: object) -> str:
    """A path or value from the environment or a file, inside markup: escaped, never markup."""
    from rich.markup import escape

    return escape(one_line(value))


def cmd_submit(args: argparse.Namespace) -> int:
    from jobs import runs

    cfg = load(args)
    if args.dry_run:
        return _dry_run(cfg, args, rich_console())
    run, job_id, sealed, prep_id = runs.submit(cfg, project_dir(), force=args.force, prepare=args.prepare,
                                               before_writing=check_controller)
    console = _submitted(args, job_id, sealed.notes)
    if prep_id:
        console.print(f"data preparation job [bold]{prep_id}[/] (log {_plain(run.log_path(prep_id))}); the training "
                      "job starts once it has completed", soft_wrap=True)
    resumed = sum(1 for x in run.launches() if x.kind == "train") > 1
    console.print(f"{'resubmitted' if resumed else 'submitted'} [bold]{cfg.run.name}[/] as job [bold]{job_id}[/]"
                  f"{' (resumes from its latest checkpoint)' if resumed else ''}  run dir: {_plain(run.dir)}",
                  soft_wrap=True)
    if sealed.replaced:
        console.print(f"config replaced (--force): {_plain(sealed.replaced)}", soft_wrap=True, highlight=False)
    if sealed.pin.path:
        console.print(f"[dim]image {_plain(sealed.pin.path)} ({sealed.pin.source}"
                      f"{', build ' + sealed.pin.build_hash[:12] if sealed.pin.build_hash else ''})[/]",
                      soft_wrap=True)
    if not args.show_logs:
        return 0
    console.print(f"following {_plain(run.log_path(job_id))} until the job ends (Ctrl-C stops following, "
                  "not the job)", style="dim", soft_wrap=True)
    code = _follow(console, run, job_id)
    console.print(f"job {job_id} ended with exit code {code}")
    return code


def _dry_run(cfg, args: argparse.Namespace, console) -> int:
    """`submit --dry-run`: the verdict, with the flags that clear its refusals (checked); nothing written."""
    sealed, refusals, notes = _refusals(cfg, args.prepare, args.force)
    flags = {"--prepare" for r in refusals if r.startswith("data: ")} | {
        "--force" for r in refusals if r.startswith("run.name: ")}
    fix = ""
    if flags and not _refusals(cfg, args.prepare or "--prepare" in flags, args.force or "--force" in flags, False)[1]:
        fix = f"slipway submit {cfg.config_args} {' '.join(sorted(flags))}"
    scfg, paths, pin, code = sealed.cfg, sealed.paths, sealed.pin, sealed.snapshot
    s = scfg.slurm
    where = (f"{s.nodes} node(s) x {scfg.launch.procs_per_node} process(es)"
             f"{f' x {s.gpus_per_node} GPU(s)' if s.gpus_per_node else ''}, time {s.time}"
             + "".join(f", {k} {v}" for k, v in (("partition", s.partition), ("account", s.account)) if v)
             + f"; runtime {scfg.container.runtime}, launcher {scfg.launcher} ({scfg.launch_choice[1]})"
             + (f"; cluster {scfg.cluster.name}" if scfg.cluster is not None else ""))
    built = f"build {pin.build_hash[:12]}" if pin.build_hash else "not built yet" if pin.source == "none" else pin.source
    image = f"{pin.image} ({built})" if pin.image else "none: this environment's Python on the nodes"
    source = (f"git {code.commit[:12]}{' with uncommitted changes' if code.dirty else ''}" if code and code.commit
              else "not a git checkout")
    code_line = (f"a snapshot of this checkout ({source}; {code.files} files, {code.hash12})" if code
                 else "the image's own (code.snapshot: false)")
    files = [(path, sealed.files[path]) for path in (paths.job_script, paths.env_toml) if path in sealed.files]
    return verdict(console, [("dry run", f"{scfg.run.name} ({'resumes' if paths.manifest.is_file() else 'new run'}) "
                                         f"in {paths.path}: nothing written, nothing submitted"),
                             ("where", where), ("image", image), ("code", code_line)],
                   "submitted", refusals, notes, files, fix)


def _refusals(cfg, prepare: bool, force: bool, ping: bool = True):
    """(sealed, refusals, notes) of `submit` with these flags; `ping`: ask the controller too (a note)."""
    from jobs import runs
    from jobs.cli.doctor import controller_problem
    from jobs.cli.gpu_stack import gpu_stack

    sealed = runs.seal(cfg, project_dir(), dry_run=True)
    refusals = [n.removeprefix(REFUSED) for n in sealed.notes if n.startswith(REFUSED)]
    notes = [n for n in sealed.notes if not n.startswith(REFUSED)]
    notes += [f"{name}: {detail}" for name, _, detail in gpu_stack(sealed.cfg, sealed.env, sealed.pin)]
    paths = sealed.paths
    try:
        runs.check_submittable(sealed.cfg)
        done = runs.nothing_to_train(sealed.cfg, paths.path, "submit")
        why = runs.unprepared_data(sealed, cfg.config_args)
        differs = paths.manifest.is_file() and runs.config_difference(paths.config, sealed.files[paths.config])
        refusals += [f"train.steps: {done}"] if done else []
        refusals += [f"data: {why}"] if why and not prepare else []
        notes += ["the token cache is not prepared: a CPU job would prepare it first, and the training job wait "
                  "for it (--prepare)"] if why and prepare else []
        refusals += [f"run.name: run {sealed.cfg.run.name} exists with {differs}: pass --force to replace its config"
                     ] if differs and not force else []
        # Where this shell reaches no controller, the submission is still judged: said, not counted.
        notes += [f"{problem} (a real submission from here would fail at sbatch)"] if ping and (
            problem := controller_problem()) else []
    except ConfigError as exc:
        refusals.append(str(exc))
    return sealed, refusals, notes


def verdict(console, head: list[tuple[str, str]], would: str, refusals: list[str], notes: list[str],
            files: list[tuple[Path, str]] = (), fix: str = "") -> int:
    """A dry run's verdict: what it would do (`head`), whether it `would` be done or what refuses it, its
    notes and files, and the verdict again last, so that nothing scrolls it away; exit 2 where refused."""
    from rich.markup import escape

    said = "[green]would be " + would + "[/]" if not refusals else f"[red]would be refused[/] ({len(refusals)})"
    reasons = [f"  - {escape(mask(as_typed(r)))}" for r in refusals] + (
        [escape(as_typed(f"  `{fix}` clears {'it' if len(refusals) == 1 else 'them all'}"))] if fix else [])
    for label, text in [*head, ("verdict", None)]:
        console.print(f"[bold]{label}:[/] {said if text is None else escape(text)}", soft_wrap=True, highlight=False)
    for line in reasons:
        console.print(line, soft_wrap=True, highlight=False)
    print_notes(console, notes)
    for path, text in files:
        print(f"==> {path} <==", flush=True)
        sys.stdout.write(mask(text))  # launch.pre_launch is the user's own text
        sys.stdout.flush()
    console.print(f"[bold]dry run:[/] nothing written; {said}", soft_wrap=True, highlight=False)
    for line in reasons if files else []:
        console.print(line, soft_wrap=True, highlight=False)
    return 2 if refusals else 0


def check_controller() -> None:
    """Once the input is checked and before anything is written: a submission no controller
    would take fails with doctor's one-line diagnosis, not sbatch's resolver errors."""
    from jobs.cli.doctor import controller_problem
    from jobs.slurm import SlurmError

    if problem := controller_problem():
        raise SlurmError(problem)


def cmd_prepare(args: argparse.Namespace) -> int:
    from jobs import runs

    cfg = load(args)
    if args.as_job:
        run, job_id, sealed = runs.submit_prepare(cfg, project_dir(), force=args.force)
        console = _submitted(args, job_id, sealed.notes)
        console.print(f"submitted the data preparation of [bold]{cfg.run.name}[/] as job [bold]{job_id}[/] "
                      f"(log {run.log_path(job_id)}); `{invocation()} submit {cfg.config_args}` once it has completed, "
                      "or now with --prepare to queue it behind", soft_wrap=True)
        return _follow(console, run, job_id) if args.show_logs else 0
    console = rich_console()
    require_extra("prepare", "trainer", ("numpy", "tokenizers", "datasets"),
                  instead=f"prepare in the image as a CPU job: slipway prepare {cfg.config_args} --as-job")
    from jobs import interactive

    interactive.prepare_here(*runs.preparation(cfg, project_dir()), console, num_proc=args.cpus)
    console.print(f"[green]prepared[/]: `{invocation()} submit {cfg.config_args}` will only open this cache",
                  soft_wrap=True)
    return 0


def cmd_local(args: argparse.Namespace, parse) -> int:
    """`parse`: the command line's parser (jobs/cli/commands.py's, which calls this)."""
    from jobs import interactive, local_checks

    cfg = load(args)
    builtin = cfg.data.dataset == "builtin" and not cfg.data.validation_split  # the shipped corpus: no datasets
    require_extra("local", "trainer", [m for m in EXTRAS["trainer"] if not (builtin and m == "datasets")])
    named = getattr(args, "set:run.name") is not None or any(o.startswith("run.name=") for o in args.overrides)

    def reload(words: list[str]):  # a `slipway local` command line, loaded as it would be when pasted
        return load(parse(["local", *words]), quiet=True)

    console = rich_console()
    try:
        if not args.dry_run:
            return interactive.run_local(cfg, project_dir(), force=args.force, console=console, rename=not named,
                                         yes=args.yes, prepare=args.prepare, reload=reload)
        sealed, plan = interactive.try_here(cfg, project_dir(), force=args.force, console=console,
                                            rename=not named, prepare=args.prepare, reload=reload)
    except local_checks.Refused as exc:  # every blocker on a line of its own, then what clears them all
        for line in exc.plan.lines():
            print(f"slipway: error: {mask(one_line(as_typed(line)), values=True)}", file=sys.stderr)
        return 2
    exists = sealed.paths.manifest.is_file()
    reasons = [str(b) for b in plan.blockers if not (b.field == "train.steps" and args.yes)]
    return verdict(console, [("dry run", f"{sealed.cfg.run.name} ({'resumes' if exists else 'new run'}) in "
                                         f"{sealed.paths.path}: nothing written, nothing started"),
                             ("where", f"this machine: {sealed.cfg.launch.procs_per_node} process(es) on its CPUs")],
                   "started", reasons, [], fix=f"slipway local {plan.fix}" if plan.fix and reasons else "")


def cmd_run(args: argparse.Namespace) -> int:
    from jobs import interactive

    if args.stop_warm:
        return _stop_warm(args)
    if not args.config:
        raise ConfigError("CONFIG", "name the config to run (slipway run CONFIG), or pass --stop-warm")
    return interactive.run_in_allocation(load(args), project_dir(), force=args.force, console=rich_console())


def _stop_warm(args: argparse.Namespace) -> int:
    from jobs.slurm import warm

    if args.config or args.overrides:
        raise ConfigError("--stop-warm", "stops every warm process of the allocation: give no config with it")
    job = environ.job_id()
    if not job:
        raise ConfigError("--stop-warm", "not inside a Slurm allocation: run it in the allocation's shell")
    steps = warm.stop(job)
    print(f"asked {len(steps)} warm step(s) of allocation {job} to stop: {', '.join(steps)}" if steps
          else f"allocation {job} keeps no warm processes")
    return 0


def cmd_edf(args: argparse.Namespace) -> int:
    from edf import check_edf, install_edf, render_edf, srun_flags
    from jobs.slurm.ranks import shell_value

    if args.check or args.to_pyxis:
        path = Path(args.check or args.to_pyxis)
        notes: list[str] = []
        # --check also looks for the image file and mount sources; --to-pyxis may run elsewhere.
        env, problems = check_edf(path, notes=notes if args.check else None)
        print_notes(rich_console(stderr=True), notes)
        for problem in problems:
            print(f"slipway: error: {problem}", file=sys.stderr)
        if problems:
            print(f"{path}: {len(problems)} problem(s)", file=sys.stderr)
            return 2
        if args.check:
            print(f"{path}: ok" + (f" ({len(notes)} path(s) not judged, see the notes)" if notes else ""))
            return 0
        env.runtime = "pyxis"
        flags = srun_flags(env)
        print_notes(rich_console(stderr=True), flags.warnings)
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
    print_notes(rich_console(), sealed.notes)
    if args.install:
        edf_dir = cfg.cluster.cluster.edf_dir if cfg.cluster is not None else None  # the cluster's EDF_PATH there
        print(install_edf(sealed.env, cfg.container.edf_name or cfg.run.name, edf_path=edf_dir, force=args.force))
    else:
        sys.stdout.write(mask(render_edf(sealed.env)))
    return 0


def cmd_shell(args: argparse.Namespace) -> int:
    from jobs import shell

    cfg = load(args)
    say = functools.partial(print_notes, rich_console(stderr=True))  # masked, one line each, as typed
    if args.dry_run:
        text, notes = shell.shell_dry_run(cfg, project_dir(), command=args.command)
        say(notes)
        sys.stdout.write(mask(text))  # --command is the user's own text
        return 0
    return shell.run_shell(cfg, project_dir(), say, command=args.command)
