"""metrics.jsonl read as the run's history (`slipway plot`, `slipway status`). The file is
append-only across attempts: a resume from step N logs `{"kind": "restart", "step": N}`, then N+1...
again; the history keeps, for every (kind, step), what the latest attempt logged, and drops the steps
a restart undid. No torch, nothing of the host side.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Optional

from common.errors import ConfigError
from common.fs import read_file
from common.rundir import RunDir

MAX_METRICS_BYTES = 1 << 30  # a million steps' records are about 300 MiB


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of run_dir/metrics.jsonl in file order (a line cut by a crash is skipped)."""
    path = RunDir(Path(run_dir)).metrics
    found = read_file(path, MAX_METRICS_BYTES)  # a FIFO or a device raises NotRegularFile: never a hang
    if found is None:
        raise ConfigError("RUN", f"{path} does not exist yet: the run has not logged a step")
    data = found[0]
    if data is None:
        raise ConfigError("RUN", f"{path} is larger than {MAX_METRICS_BYTES >> 30} GiB, more than any run logs: "
                                 "check that it is the run's own")
    return records_of(data)


def records_of(data: bytes) -> list[dict[str, Any]]:
    """The records of metrics.jsonl's bytes `data`, without a line a crash cut."""
    records = []
    for line in data.decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def latest_by_step(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history that stands (the module's rule) in step order, without restart or stepless records."""
    kept: dict[tuple[str, int], dict[str, Any]] = {}
    for record in records:
        step = record.get("step")
        if not isinstance(step, int):
            continue
        if record.get("kind") == "restart":
            kept = {key: r for key, r in kept.items() if key[1] <= step}
            continue
        kept.pop((str(record.get("kind")), step), None)  # re-inserted last: file order among equals
        kept[(str(record.get("kind")), step)] = record
    return sorted(kept.values(), key=lambda r: r["step"])


def format_duration(seconds: Optional[float], fine: bool = False) -> str:
    """12s, 3m05s, 1h02m, 12d04h; ? when unknown (or no finite number: what a file said). `fine`:
    below a second to two digits (0.21s), for a step's time (elsewhere 0s)."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds):
        return "?"
    if fine and 0 < seconds < 0.995:
        return f"{seconds:.2g}s"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 3 * 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"
