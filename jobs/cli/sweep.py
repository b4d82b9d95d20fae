"""`slipway sweep` (listed with --dry-run, queued as job arrays, or run here with --local), and the
commands that read a sweep or runs together: `status SWEEP`, `cancel SWEEP`, `compare`, `plot SWEEP`."""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Optional

from common.environ import as_typed
from common.extras import require
from common.errors import ConfigError, one_line
from common.secrets import mask
from common.rundir import INTERRUPTED_EXIT, RunDir
from jobs.cli.launch import check_controller, cluster_of, config_sets, print_notes, project_dir, rich_console, verdict
from jobs.cli.status import listing, listing_rows, tokens, width
from jobs.runs import arrays
from jobs.runs import sweep as sweeps
from jobs.runs.manifest import ManifestError
from jobs.runs.run import Run, find_run, runs_root


def sweep_named(name: str, project: Path) -> Optional[sweeps.Sweep]:
    """The sweep `name`, where no run has that name (a run is found as ever); None if none."""
    if RunDir(runs_root(project) / name).manifest.is_file():
        return None
    return sweeps.find_sweep(name, project)


def cmd_sweep(args: argparse.Namespace) -> int:
    from jobs import local_checks
    from jobs.config import read_config

    if args.max_parallel is not None and args.max_parallel < 1:
        raise ConfigError("--max-parallel", f"must be at least 1, got {args.max_parallel}")
    project, console = project_dir(), rich_console()
    sets, given = config_sets(args)

    def here(cfg):  # a point as `slipway local` runs it, checked to fit in this machine's memory
        local, _ = local_checks.local_view(cfg, rename=False)
        local_checks.check_memory(local)
        return local

    if args.local:
        require("sweep --local", "trainer")
    _, plain = sweeps.split_axes(args.overrides)
    variants = sweeps.Variants(*read_config(args.config), plain, sets, cluster_of(args))
    base = variants.base
    # As `slipway local` keeps a cluster config's trial apart (RUN-local), so does a sweep's.
    apart = args.local and bool(local_checks.local_view(base, rename=False)[1])
    name = args.name or base.run.name + ("-local" if apart else "")

    def plan(dry_run: bool) -> arrays.Plan:
        return arrays.plan_sweep(variants, args.config, args.overrides, project, name=name, points_file=args.points,
                                 given_args=given, dry_run=dry_run, force=args.force,
                                 view=here if args.local else None)
    if args.dry_run:
        return _dry_run(plan(True), args.max_parallel, console, here=args.local)
    with arrays.hold(project, name, f"slipway sweep {given}"):
        planned = plan(False)
        print_notes(console, planned.notes)
        if args.local:
            return _run_here(planned, project, args.force, console, yes=args.yes)
        queued = arrays.submit_sweep(planned, project, force=args.force, max_parallel=args.max_parallel,
                                     before_writing=check_controller)
    console.print(_summary(planned), soft_wrap=True, highlight=False)
    for array in queued:
        console.print(f"submitted array [bold]{array.job_id}[/] ({len(array.points)} point(s), tasks "
                      f"{arrays.array_spec(len(array.points), args.max_parallel)})" if array.script.endswith(
                          "array.sbatch") else f"submitted job [bold]{array.job_id}[/] (point {array.points[0]})",
                      soft_wrap=True, highlight=False)
    if queued:
        console.print(as_typed(f"`slipway status {name}` follows it; `slipway compare {name}` ranks its points"),
                      soft_wrap=True, highlight=False, markup=False)
    return 0


def _summary(plan: arrays.Plan, to: str = "submit") -> str:
    counts = {state: sum(p.state == state for p in plan.points)
              for state in (arrays.NEW, arrays.RESUME, arrays.FINISHED, arrays.ACTIVE, arrays.UNREADABLE)}
    told = ", ".join(f"{n} {state}" for state, n in counts.items() if n)
    todo = plan.to_submit
    return (f"sweep {plan.sweep.name}: {len(plan.points)} point(s): {told}; "
            + (f"{len(todo)} to {to}" if todo else f"nothing to {to}"))


def _dry_run(plan: arrays.Plan, max_parallel: Optional[int], console, here: bool = False) -> int:
    """Every point, the resources in all, the arrays (`here`: none, no Slurm) and the verdict; nothing written."""
    from jobs import slurm

    rows, node_h, gpu_h, unbounded, limits = [], 0.0, 0.0, 0, {}
    todo = plan.to_submit
    for p in plan.points:  # points share the slurm section an axis leaves alone: its limit read once
        s = p.cfg.slurm
        seconds = limits[id(s)] if id(s) in limits else limits.setdefault(id(s), s.time_seconds())  # None: no limit
        slurm_asks = () if here else (str(s.nodes), str(s.nodes * s.gpus_per_node), s.time)  # no allocation here
        rows.append((p.point.run, p.state, *slurm_asks, p.point.label()))
        if p.state in (arrays.NEW, arrays.RESUME):
            unbounded += seconds is None
            node_h += s.nodes * (seconds or 0) / 3600
            gpu_h += s.nodes * s.gpus_per_node * (seconds or 0) / 3600
    out = console.file
    out.write(listing(f"dry run: {_summary(plan, 'run here' if here else 'submit')}; nothing written, nothing "
                      f"{'started' if here else 'submitted'}", rows, width(),
                      ("point", "state", *(() if here else ("nodes", "GPUs", "time")), "values")))
    if here:  # each point already checked to fit this machine's memory (the plan's view); no Slurm
        out.write("one after another, each as slipway local runs it\n")
        return verdict(console, [], "started", [str(r) for r in plan.refusals], plan.notes)
    out.write(f"at the time limit: {node_h:.1f} node-hours, {gpu_h:.1f} GPU-hours for the points to submit"
              + (f" ({unbounded} without a limit)" if unbounded else "") + "\n")
    try:
        limit, where = slurm.max_array_size(), "scontrol show config"
    except slurm.SlurmError as exc:
        limit, where = 1001, f"Slurm's default, as {one_line(exc)}"
    if not limit:
        out.write(f"no arrays: MaxArraySize 0 ({where}), this site allows none: each of the {len(todo)} point(s) to "
                  "submit goes as a job of its own\n")
    for i, chunk in enumerate(arrays.arrays_of(todo, limit) if limit else []):
        spec = arrays.array_spec(len(chunk), max_parallel)
        asks = " ".join(line[8:] for line in arrays.allocation(chunk[0].sealed) if line.startswith("#SBATCH "))
        out.write(f"array {i + 1}: {len(chunk)} point(s), --array={spec} (at most {spec.split('%')[1]} at once: "
                  f"--max-parallel; MaxArraySize {limit}, {where}): {asks}\n")
    from jobs.cli.doctor import controller_problem

    refusals = [str(r) for r in plan.refusals] + ([p] if todo and (p := controller_problem()) else [])
    return verdict(console, [], "submitted", refusals, plan.notes)


def _run_here(plan: arrays.Plan, project: Path, force: bool, console, *, yes: bool) -> int:
    """--local: each point through `slipway local`'s path, one after another; a failed point does
    not stop the others, Ctrl-C stops them all. Exits with the first failure's code (130 after Ctrl-C)."""
    from jobs import interactive

    if plan.refusals:
        raise plan.refusals[0]
    sweeps.write_sweep(sweeps.sweep_dir(project, plan.sweep.name) / "sweep.json", plan.sweep)
    ends: list[tuple[str, int]] = []
    for i, p in enumerate(plan.points, 1):
        console.print(f"[bold]point {i}/{len(plan.points)}: {p.point.run}[/] ({p.point.label()})", soft_wrap=True,
                      highlight=False)
        try:
            rc = interactive.run_local(p.cfg, project, force=force, console=console, rename=False, yes=yes)
        except ConfigError as exc:  # that point alone (a run launched meanwhile, a job of it queued)
            print(f"slipway: error: {mask(one_line(as_typed(str(exc))), values=True)}", file=sys.stderr)
            rc = 2
        ends.append((p.point.run, rc))
        if rc == INTERRUPTED_EXIT:
            break
    failed = [(run, rc) for run, rc in ends if rc]
    console.print(f"sweep {plan.sweep.name}: {len(ends) - len(failed)} of {len(plan.points)} point(s) ended 0"
                  + (f"; {', '.join(f'{run} exit {rc}' for run, rc in failed)}" if failed else ""), soft_wrap=True,
                  highlight=False)
    # Ctrl-C is said as such to a calling script (make, a shell loop), whatever failed before it.
    return INTERRUPTED_EXIT if ends[-1:] and ends[-1][1] == INTERRUPTED_EXIT else failed[0][1] if failed else 0


def show_sweep(project: Path, sweep: sweeps.Sweep, console) -> int:
    """One line per point (its latest launch's state, step, loss, tokens/s): one Slurm query for all."""
    rows, damaged, _ = listing_rows(sweep.runs(project), throughput=True)
    states = Counter(row[3] for row in rows)
    arrays = ", ".join(a.job_id for a in sweep.arrays) or "none"
    title = (f"sweep {sweep.name}: {len(rows)} point(s) ({', '.join(f'{n} {s}' for s, n in sorted(states.items()))}); "
             f"arrays {arrays}")
    console.file.write(listing(title, rows, width()))
    for message in damaged:
        print(f"slipway: error: {one_line(message)}", file=sys.stderr)
    return 2 if damaged else 0


def cancel_sweep(project: Path, sweep: sweeps.Sweep, console) -> int:
    """Every active task of every point, as `slipway cancel` ends a run's jobs, under the sweep's lock."""
    from jobs.cli.status import cancel_jobs

    damaged = []
    with arrays.hold(project, sweep.name, f"slipway cancel {sweep.name}"):
        found = []
        for run in sweep.runs(project):
            if run.paths.manifest.is_file():
                try:
                    found.append((run, run.launches()))
                except ManifestError as exc:
                    damaged.append(exc)
        cancelled = cancel_jobs(found)
    console.print(f"cancelled {len(cancelled)} task(s) of sweep {sweep.name}" if cancelled else
                  f"sweep {sweep.name} has no active task", soft_wrap=True, highlight=False)
    for exc in damaged:
        print(f"slipway: error: {exc.restated('slipway cannot tell its jobs', 'scancel them by id')}",
              file=sys.stderr)
    return 2 if damaged else 0


def plot_sweep(project: Path, sweep: sweeps.Sweep, out: Optional[str]) -> int:
    """The points' loss curves overlaid; one that cannot be drawn (no steps yet, unreadable) is left out, saying why."""
    from jobs import trainer_door

    target = Path(out) if out else sweeps.sweep_dir(project, sweep.name) / "curves.png"
    print(trainer_door.plot([run.dir for run in sweep.runs(project)], target, [p.label(60) for p in sweep.points],
                            title=f"sweep {sweep.name}"))
    return 0


# ---------------------------------------------------------------- compare

COMPARED = ("eval", "train", "tok/s", "MFU", "progress", "state", "run")


def _compared(project: Path, names: list[str]) -> tuple[list[Run], list[str], list[dict[str, Any]], list[str]]:
    """The runs named (a sweep's points for a sweep), the keys that tell them apart, each run's
    values, and a line for each run whose config cannot be read (its values are then unknown)."""
    found: list[tuple[Run, dict]] = []
    keys: list[str] = []
    for name in names:
        sweep = sweep_named(name, project)
        if sweep is not None:
            keys += sweep.axes
            found += [(run, p.values) for run, p in zip(sweep.runs(project), sweep.points)]
        else:
            found.append((find_run(name, project), {}))
    if len(names) > 1 or not keys:  # runs of their own (or several sweeps): the config keys that differ
        return [run for run, _ in found], *_differing([run for run, _ in found])
    return [run for run, _ in found], list(dict.fromkeys(keys)), [v for _, v in found], []


def _differing(found: list[Run]) -> tuple[list[str], list[dict[str, Any]], list[str]]:
    import yaml

    from common.yaml import read_text_bounded

    def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(tree, dict):
            return {prefix[:-1]: tree}
        return {k: v for key, value in tree.items() for k, v in flat(value, f"{prefix}{key}.").items()}
    configs, unread = [], []
    for run in found:
        try:
            configs.append(flat(yaml.safe_load(read_text_bounded(run.paths.config, "config.yaml")) or {}))
        except (OSError, ConfigError, yaml.YAMLError) as exc:  # that run's values unknown: it is compared all the same
            configs.append({})
            unread.append(f"run {run.name}: {run.paths.config.name} cannot be read, its values are left out "
                          f"({getattr(exc, 'strerror', None) or exc})")
    keys = sorted({k for c in configs for k in c})
    differ = [k for k in keys if k != "run.name" and len({repr(c.get(k)) for c in configs}) > 1
              and not any(run.name in str(c.get(k, "")) for run, c in zip(found, configs))]
    return differ, [{k: c.get(k) for k in differ} for c in configs], unread


def compare(project: Path, names: list[str], as_csv: bool, console) -> int:
    """The runs side by side, by final eval loss (then train loss); one Slurm query for all."""
    found, keys, values, unread = _compared(project, names)
    rows, damaged, read = listing_rows(found)
    table = []
    for run, vals, row, f in zip(found, values, rows, read):
        train, ev = (f.train, f.eval) if f else ({}, {})
        table.append({"run": run.name, "values": vals, "train": train.get("loss"), "eval": ev.get("eval_loss"),
                      "tps": train.get("tokens_per_s"), "mfu": train.get("mfu"), "step": train.get("step"),
                      "steps": f.total if f else None, "state": row[3]})
    table.sort(key=lambda r: (_number(r["eval"]) is None, _number(r["eval"]) or 0.0,
                              _number(r["train"]) is None, _number(r["train"]) or 0.0))
    if as_csv:  # every cell escaped as on a terminal: a CSV is read on one
        writer = csv.writer(sys.stdout)
        writer.writerow(map(one_line, ["run", *keys, "eval_loss", "train_loss", "tokens_per_s", "mfu", "step", "steps",
                                       "state"]))
        for r in table:
            values = [sweeps.value_text(r["values"][k]) if k in r["values"] else "" for k in keys]
            numbers = ["" if r[c] is None else r[c] for c in ("eval", "train", "tps", "mfu", "step", "steps")]
            writer.writerow(map(one_line, [r["run"], *values, *numbers, r["state"]]))
    else:
        _compare_table(table, keys, console)
    # One line for each run not shown whole: why (a teammate's is no error), and the damaged ones' errors.
    for line in unread + [f"run {row[0]}: {row[-1]}" for row in rows if row[3] == "UNREADABLE"]:
        print(f"slipway: note: {one_line(line)}", file=sys.stderr)
    for message in damaged:
        print(f"slipway: error: {one_line(message)}", file=sys.stderr)
    return 2 if damaged else 0


def _number(x: Any) -> Optional[float]:
    return x if isinstance(x, (int, float)) else None


def _compare_table(table: list[dict], keys: list[str], console) -> None:
    shown = keys[:3]  # the table fits 80 columns; --csv has every key
    # An axis by its short key, or whole where that is a column's name (`train.steps`, not a second `steps`).
    heads = tuple((k if h in COMPARED else h)[:16] for k, h in zip(shown, sweeps.short_keys(shown))) + COMPARED

    def cell(x: Any, fmt: str) -> str:
        return "" if _number(x) is None else format(x, fmt)
    out = [(*(sweeps.value_text(r["values"].get(k, ""))[:16] for k in shown),
            cell(r["eval"], ".4f"), cell(r["train"], ".4f"),
            tokens(r["tps"]) if _number(r["tps"]) is not None else "",
            cell(100 * r["mfu"], ".1f") + "%" if _number(r["mfu"]) is not None else "",
            f"{r['step'] or 0}/{r['steps']}" if r["steps"] else "", r["state"], r["run"]) for r in table]
    title = f"{len(table)} run(s) by eval loss" + (f"; {len(keys) - 3} more key(s) differ: --csv" if len(keys) > 3
                                                   else "")
    console.file.write(listing(title, out, width(), heads))
