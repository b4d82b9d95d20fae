"""Bad nodes remembered per cluster: what one job blamed, later jobs of that cluster exclude.

`RUNS/.nodes/CLUSTER/NODE`, one file per node, under the runs root: every node of every job reaches
it (a user's $HOME need not be mounted on compute nodes). The batch script writes a record, whole
and renamed into place, when it blames a node (bad_nodes_lib.sh) and removes it when a preflight
there passes. The host reads them at each submission (`plan_exclusions`) and in `slipway nodes`;
a record expires after the profile's `cluster.forget_bad_nodes_after`. A record that cannot be
read is named, never trusted, never fatal. CLUSTER: jobs/config/clusters.py `key`.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from common.environ import WORD, as_typed
from common.errors import ConfigError, one_line, pasteable, shown
from common.fs import NotRegularFile, open_regular
from common.tagged import TaggedLine
from jobs.config import clusters
from jobs.slurm import client as slurm

NODES_DIR = ".nodes"
NODE_NAME = WORD  # a node's name, as $SLURMD_NODENAME is checked and job_lib.sh checks one before writing it
MAX_RECORD = 4096
SKEW = 600  # seconds a record may be dated ahead of this host's clock (a node's clock runs ahead): never more


@dataclass(frozen=True)
class BadNode(TaggedLine):
    """A node's record, one line (bad_nodes_lib.sh writes it); `since`: the first blame still standing."""

    node: str
    since: str
    at: str
    run: str
    job: str
    kind: str
    reason: str

    TAG = "slipway-bad-node"
    REST = "reason"

    def valid(self) -> bool:
        return bool(aware_time(self.at) and aware_time(self.since) and NODE_NAME.fullmatch(self.node))

    def age(self, now: datetime) -> float:
        return (now - aware_time(self.at)).total_seconds()


def aware_time(stamp: str) -> Optional[datetime]:
    """The time an ISO 8601 stamp with its offset says (lifecycle.py's too); None for any other."""
    try:
        when = datetime.fromisoformat(stamp)
    except ValueError:
        return None
    return when if when.tzinfo else None  # naive and aware times do not compare


@dataclass
class Recall:
    live: list[BadNode] = field(default_factory=list)  # newest blame first
    expired: list[BadNode] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)  # one line each: the file and why


@dataclass(frozen=True)
class BadNodes:

    dir: Path
    cluster: str

    def read(self, forget_after: int, now: Optional[datetime] = None) -> Recall:
        now = now or datetime.now(timezone.utc)
        recall = Recall()
        try:
            names = sorted(n for n in os.listdir(self.dir) if not n.startswith("."))
        except FileNotFoundError:
            return recall
        except OSError as exc:
            recall.damaged.append(f"{self.dir}: cannot be listed ({exc.strerror})")
            return recall
        for name in names:
            record = self._read_one(name, recall)
            if record is None:
                continue
            if record.age(now) < -SKEW:  # else it would stand until that date, excluding the node all along
                recall.damaged.append(f"{self.dir / name}: dated {record.at}, ahead of this host's clock "
                                      f"(`slipway nodes{forgetting(self.cluster, [name])}` removes it)")
                continue
            (recall.live if forget_after and record.age(now) < forget_after else recall.expired).append(record)
        recall.live.sort(key=lambda r: aware_time(r.at), reverse=True)
        return recall

    def _read_one(self, name: str, recall: Recall) -> Optional[BadNode]:
        path = self.dir / name
        try:
            f = open_regular(path)
            if f is None:
                return None
            with f:
                data = f.read(MAX_RECORD)
        except NotRegularFile as exc:
            recall.damaged.append(f"{path}: {exc.strerror}")
            return None
        except OSError as exc:
            recall.damaged.append(f"{path}: cannot be read ({exc.strerror})")
            return None
        record = BadNode.parse(data.decode("utf-8", errors="replace").split("\n", 1)[0])
        if record is None or record.node != name:
            recall.damaged.append(f"{path}: not a bad node's record (`slipway nodes{forgetting(self.cluster, [name])}` "
                                  "removes it)")
            return None
        return record

    def forget(self, node: str) -> bool:
        """Remove `node`'s record (a damaged one by the name it has); False when there was none."""
        path = self.dir / node
        damaged = not (node.startswith(".") or "/" in node) and os.path.lexists(path)  # by its own name
        if not NODE_NAME.fullmatch(node) and not damaged:
            raise ConfigError("--forget", f"{shown(node)} is not a node name (letters, digits, '.', '_' or '-')")
        if not os.path.lexists(path):
            return False
        if path.is_dir() and not path.is_symlink():
            raise ConfigError("--forget", f"{path} is a directory, not a node's record: remove it by hand")
        path.unlink()
        return True


@dataclass
class Exclusions:

    nodes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def bad_nodes_of(profile: Optional[clusters.ClusterProfile], runs_root: Path) -> tuple[BadNodes, int]:
    """The remembered bad nodes of `profile`'s cluster and how long its records stand."""
    after = profile.cluster.forget_bad_nodes_after if profile is not None else clusters.DAY
    key = clusters.key(profile)
    return BadNodes(Path(runs_root) / NODES_DIR / key, key), after


def bad_nodes_settings(cfg, runs_root: Path) -> list[str]:
    """The batch script's lines that say where the cluster remembers bad nodes (bad_nodes_lib.sh)."""
    remembered, after = bad_nodes_of(cfg.cluster, runs_root)
    where = shlex.quote(str(remembered.dir)) if after else "''"
    return ["# The bad nodes this cluster remembers (a node the job blames is excluded from its later jobs).",
            f"CLUSTER={shlex.quote(remembered.cluster)} BAD_NODES_DIR={where}"]


def plan_exclusions(cfg, runs_root: Path) -> Exclusions:
    """The remembered bad nodes `cfg`'s job excludes: those its partition knows (sbatch refuses others),
    newest blame first, while enough usable nodes are left; the notes say which and why. One sinfo."""
    remembered, after = bad_nodes_of(cfg.cluster, runs_root)
    recall = remembered.read(after) if after else Recall()
    out = Exclusions(notes=[f"a remembered bad node's record is damaged: {d}" for d in recall.damaged])
    if not recall.live:
        return out
    try:
        partition, states = slurm.partition_nodes(cfg.slurm.partition)
    except slurm.SlurmError as exc:  # no sinfo here (a dry run), or no answer, where sbatch fails alike
        out.notes.append(f"cluster {remembered.cluster} remembers bad nodes ({_names(recall.live)}) but sinfo could not "
                         f"list the partition's nodes ({exc}): none excluded")
        return out
    known = [r for r in recall.live if r.node in states]
    usable = sum(1 for s in states.values() if slurm.usable_state(s))
    needed, left = cfg.slurm.nodes, []
    for record in known:
        if not slurm.usable_state(states[record.node]):
            out.nodes.append(record.node)  # Slurm would not place the job there anyway
        elif usable - 1 >= needed:
            out.nodes.append(record.node)
            usable -= 1
        else:
            left.append(record)
    if out.nodes:
        out.notes.append(f"excluding the bad nodes cluster {remembered.cluster} remembers: "
                         f"{_described([r for r in known if r.node in out.nodes])}; "
                         f"`slipway nodes{forgetting(remembered.cluster, out.nodes)}` to use them again")
    if left:
        out.notes.append(f"not excluding {_described(left)}, remembered as bad by cluster {remembered.cluster}: the job "
                         f"needs {needed} node(s) and partition {partition or '(the default)'} has {usable} usable, "
                         f"{_names(left)} included" + (", besides those excluded" if out.nodes else ""))
    return out


def forgetting(cluster: str, nodes: list[str]) -> str:
    """`slipway nodes`' arguments that forget `nodes` of `cluster`, each pasting back whole (a damaged
    record's name may hold anything)."""
    where = "" if cluster == clusters.DEFAULT else f" --cluster {pasteable(cluster)}"
    return where + "".join(f" --forget {pasteable(n)}" for n in nodes)


def _names(records: list[BadNode]) -> str:
    return ", ".join(r.node for r in records)


def _described(records: list[BadNode]) -> str:
    return "; ".join(f"{r.node} ({r.kind}, since {r.since}, run {r.run} job {r.job})" for r in records)


def merged_exclude(extra: list[str], nodes: list[str]) -> tuple[list[str], list[str]]:
    """`slurm.extra` and the nodes to exclude as one `--exclude` (sbatch keeps only the last one
    given): (extra without its --exclude, every node to exclude)."""
    kept, excluded = [], []
    for opt in extra:
        if opt.startswith("--exclude="):
            excluded += [n for n in opt.split("=", 1)[1].split(",") if n]
        else:
            kept.append(opt)
    return kept, list(dict.fromkeys(excluded + nodes))


def show(remembered: BadNodes, after: int, forget: list[str], console) -> int:
    """`slipway nodes`: the cluster's remembered bad nodes, why and since when; `--forget NODE`."""
    if forget:
        for node in forget:
            if not remembered.forget(node):
                recall = remembered.read(after)
                names = _names(recall.live + recall.expired) or "none"
                raise ConfigError("--forget", f"cluster {remembered.cluster} remembers no node {shown(node)} (it "
                                              f"remembers: {names})")
            console.print(one_line(f"forgot {node} (cluster {remembered.cluster})"), highlight=False, markup=False)
        return 0
    recall = remembered.read(after)
    now = datetime.now(timezone.utc)
    if not recall.live:
        console.print(f"cluster {remembered.cluster} remembers no bad node" + (
            f" ({len(recall.expired)} expired)" if recall.expired else ""), highlight=False, markup=False)
    for r in recall.live:
        left = int(after - r.age(now))
        console.print(one_line(f"{r.node}: {r.kind} since {r.since} (last {r.at}, run {r.run} job {r.job}; "
                               f"excluded for {left // 3600}h{left % 3600 // 60:02d}m more): {r.reason}"),
                      highlight=False, markup=False, soft_wrap=True)
    for line in recall.damaged:
        console.print(one_line(as_typed(f"damaged: {line}")), highlight=False, markup=False, soft_wrap=True)
    return 0
