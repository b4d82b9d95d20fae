"""The one door from the host into trainer/ beyond its config sections (`trainer.config`): the
trainer's own work that a host command does on this machine, each imported only when called.

- `data_status`: where a run's data stands in its token cache (`slipway submit`, `local`, `run`
  refuse an unprepared one). It reads an index and file sizes: no numpy, tokenizers or datasets,
  so the login node's base install runs it.
- `prepare`: `slipway prepare` here, tokenizing into that cache (the trainer extra).
- `plot`: `slipway plot`, the curves of one run or of several into one PNG (the plot extra).
- `check_tokens`, `hub_unreachable`: what `slipway local` checks of a prepared cache's token
  counts and of the hub before it starts.

What stands behind it imports no torch: tests/test_contract.py imports each module the door
imports with torch blocked, and holds every other host module to `trainer.config` alone. The batch
script reaches the same code as `python -m trainer.prepare` and `python -m trainer.plot`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence


def data_status(data: Any, cache_dir: Path | str):
    """Where each split of the data section `data` stands in `cache_dir` (trainer.prepare.CacheStatus)."""
    from trainer.prepare import cache_status

    return cache_status(data, cache_dir)


def check_tokens(data: Any, vocab_size: int, train: dict, validation: Optional[dict]) -> None:
    """The trainer's rules on a prepared cache's token counts (trainer.prepare.check_tokens)."""
    from trainer.prepare import check_tokens as check

    check(data, vocab_size, train, validation)


def hub_unreachable() -> Optional[str]:
    """Why the Hugging Face hub cannot be reached from here, in a few seconds; None when it can."""
    from trainer.data_sources import hub_unreachable as unreachable

    return unreachable()


def prepare(data: Any, cache_dir: Path | str, *, num_proc: int, progress: Any):
    """Tokenize what `cache_dir` lacks of `data` (trainer.prepare.CacheStatus after); a damaged cache
    is a ConfigError naming data.cache_dir."""
    from common.errors import ConfigError
    from trainer.data_cache import DataCacheError
    from trainer.prepare import prepare as tokenize

    try:
        return tokenize(data, cache_dir, num_proc=num_proc, progress=progress)
    except DataCacheError as exc:
        raise ConfigError("data.cache_dir", str(exc)) from None


def plot(run_dirs: Sequence[Path], out: Optional[Path] = None, labels: Optional[Sequence[str]] = None,
         title: str = "") -> Path:
    """The loss and throughput curves of one run (default: its curves.png), or the loss curves of
    several overlaid into `out`, with a legend of `labels` (a sweep's values)."""
    from trainer.plot import plot_run, plot_runs

    if len(run_dirs) == 1 and labels is None:
        return plot_run(run_dirs[0], out)
    return plot_runs(list(run_dirs), list(labels or [d.name for d in run_dirs]), out or run_dirs[0] / "curves.png",
                     title)
