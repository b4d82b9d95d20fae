"""The one door from the host into trainer/ beyond its config sections (`trainer.config`), each import
made only when called. What stands behind it imports no torch (tests/test_contract.py imports each module
the door imports with torch blocked); `data_status` needs not even numpy: the login node's base install runs it."""

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


def warm_code() -> tuple[str, ...]:
    """The files of trainer/ a warm process runs from, which its key hashes."""
    from trainer.warm_rank import CODE

    return CODE


def plot(run_dirs: Sequence[Path], out: Optional[Path] = None, labels: Optional[Sequence[str]] = None,
         title: str = "") -> Path:
    """The loss and throughput curves of one run (default: its curves.png), or the loss curves of
    several overlaid into `out`, with a legend of `labels` (a sweep's values)."""
    from trainer.plot import plot_run, plot_runs

    if len(run_dirs) == 1 and labels is None:
        return plot_run(run_dirs[0], out)
    return plot_runs(list(run_dirs), list(labels or [d.name for d in run_dirs]), out or run_dirs[0] / "curves.png",
                     title)
