"""`slipway cluster up | down | status | env`: the local cluster from the command line."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

from common.edge import Parser
from common.errors import ConfigError
from common.environ import as_typed, invocation
from jobs.devcluster.daemons import LocalSlurmCluster
from jobs.devcluster.host import HOSTS, ClusterError, alive, leftovers, our_netns, read_registry, teardown
from jobs.devcluster.spec import ClusterSpec, default_state_dir, spec_of_running, started_elsewhere


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="slipway cluster", description="A real Slurm cluster on this machine: munged, "
                                                                     'slurmctld and N slurmd "nodes".')
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a cluster (tearing down an earlier one of the same name)")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--cpus", type=int, default=4, help="CPUs each node declares (default 4)")
    up.add_argument("--state-dir", default=None,
                    help=f"default {default_state_dir()} (-NAME appended for another --name)")
    up.add_argument("--subnet", default="10.213.0", help="first three octets of a private /24")
    up.add_argument("--ctld-port", type=int, default=6917)
    up.add_argument("--slurmd-port", type=int, default=6918)
    up.add_argument("--timeout", type=float, default=60, help="seconds to wait for idle nodes")
    up.add_argument("--max-array-size", type=int, default=1001,
                    help="slurm.conf MaxArraySize: job array indices stay below it (default 1001, Slurm's)")
    up.add_argument("--plugstack", type=Path, help="a SPANK plugstack.conf for the nodes (e.g. loading pyxis)")
    up.add_argument("--node-private", default="", metavar="DIR,...",
                    help="directories each node gets its own copy of (e.g. enroot's and pyxis's runtime dirs)")
    sub.add_parser("down", help="stop it: processes by id, namespaces, links, /etc/hosts block")
    sub.add_parser("status", help="whether it is up, its nodes' states and its processes (exit 1 if not up)"
                   ).add_argument("--json", action="store_true", help="the same as one JSON object")
    sub.add_parser("env", help="the export line for client commands")
    for p in sub.choices.values():
        p.add_argument("--name", default="slpw", help="cluster name (prefix of namespaces and links)")
    args = ap.parse_args(argv)
    named = "" if args.name == "slpw" else f" --name {shlex.quote(args.name)}"  # a suggestion names its cluster
    try:
        if args.cmd == "up":
            if not args.timeout > 0:
                raise ConfigError("--timeout", f"{args.timeout:g}: give the seconds to wait for idle nodes, more than 0")
            state_dir = args.state_dir or default_state_dir("" if args.name == "slpw" else args.name)
            spec = ClusterSpec(state_dir=Path(state_dir), nodes=args.nodes, cpus=args.cpus, name=args.name,
                               subnet=args.subnet, ctld_port=args.ctld_port, slurmd_port=args.slurmd_port,
                               plugstack=args.plugstack, max_array_size=args.max_array_size,
                               node_private=tuple(filter(None, args.node_private.split(","))))
            t0 = time.monotonic()
            LocalSlurmCluster(spec).up(timeout=args.timeout)
            print(f"# {spec.nodes} nodes ({', '.join(spec.node_names)}) idle in partition "
                  f"{spec.partition} after {time.monotonic() - t0:.1f} s; logs in {spec.log_dir}; point Slurm's "
                  f"commands at it in this shell: eval \"$({invocation()} cluster env{named})\"", file=sys.stderr)
        else:
            spec = spec_of_running(args.name)
        if args.cmd == "down":
            _down(args.name, spec)
        elif args.cmd == "status":
            status = LocalSlurmCluster(spec).status() if spec else {"name": args.name, "up": False}
            print(json.dumps(status, indent=1) if args.json else _said(status, named))
            return 0 if status["up"] else 1
        elif spec is None:
            raise ClusterError(f"no cluster {args.name!r} is up: run `slipway cluster up{named}`")
        else:  # up, env
            elsewhere = started_elsewhere(args.name)
            if elsewhere:  # on stderr: `eval "$(slipway cluster env)"` shows it and evaluates only the export
                print(f"slipway cluster {args.cmd}: note: {elsewhere}", file=sys.stderr)
            print(f"export SLURM_CONF={shlex.quote(str(spec.conf))}")
    except ClusterError as e:
        print(f"slipway cluster {args.cmd}: {as_typed(str(e))}", file=sys.stderr)
        return 1
    return 0


def _said(status: dict, named: str) -> str:
    """`slipway cluster status` for a person: up or not, the nodes' states, the processes not alive."""
    if not status.get("processes"):
        return as_typed(f"cluster {status['name']}: not up; `slipway cluster up{named}` starts it")
    nodes = ", ".join(f"{node} {state}" for node, state in status["nodes"].items()) or "none answering"
    dead = [f"{p['role']} (pid {p['pid']})" for p in status["processes"] if not p["alive"]]
    return as_typed(f"cluster {status['name']}: {'up' if status['up'] else 'not up'}, state in {status['state_dir']}\n"
                    f"nodes: {nodes}\nprocesses: {len(status['processes']) - len(dead)} of {len(status['processes'])} "
                    f"alive{': not ' + ', '.join(dead) if dead else ''}\nits client commands here: "
                    f"`eval \"$(slipway cluster env{named})\"`")


def _down(name: str, spec: ClusterSpec | None) -> None:
    reg = read_registry(name) or {}
    running = [p["role"] for p in reg.get("processes", []) if alive(p["pid"], p["start"])]
    namespaces = our_netns(name)
    procs = teardown(name)
    if left := leftovers(name, spec.state_dir if spec else None, procs):
        raise ClusterError(f"not fully down: {', '.join(left)}")
    if not reg and not namespaces:
        print(f"no cluster {name!r} was running: nothing to stop")
        return
    print(f"stopped cluster {name!r}: {', '.join(running) or 'no live daemons'}; removed {len(namespaces)} node "
          f"namespace(s), its links and its {HOSTS} entries" + (f"; logs stay in {spec.log_dir}" if spec else "")
          + ("; `unset SLURM_CONF` in this shell" if spec and os.environ.get("SLURM_CONF") == str(spec.conf) else ""))
