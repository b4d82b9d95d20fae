"""Data prepared before the allocation: what `slipway prepare` and `submit` call.

    status = cache_status(cfg.data, cache_dir)       # cheap: no download, no lock
    if not status.prepared and not status.tokenize_in_job: refuse, print status.describe()
    status = prepare(cfg.data, cache_dir, num_proc=16, progress=console)

`prepare` downloads (where the hub is reachable) and tokenizes every split the run reads into the
token cache, so the job only opens it; entries already there are kept, an interrupted prepare
continues. Bad input raises ConfigError, a damaged cache DataCacheError. No torch here, and importing
this module takes no numpy, tokenizers or datasets, so `slipway submit` checks the cache on the login
node's base install (`prepare` itself needs the trainer extra: `slipway prepare` says so, see `common.extras`).

In the image, for a preparation job: `python -m trainer.prepare --config runs/RUN/config.yaml`.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from common.errors import ConfigError
from trainer.config import DataSection, load_trainer_config
from trainer.data_cache import CacheEntry, DataCacheError, ensure_tokens, entry_status, resolve_cache_dir
from trainer.data_sources import BUILTIN, run_sources
from trainer.data_tokenize import ProgressSink, resolve_tokenizer


def check_tokens(data: DataSection, vocab_size: int, train: dict, validation: dict | None = None) -> int:
    """The trainer's rules on the prepared entries' indexes (`n_tokens`, `vocab_size`, `source`): the
    tokens data.validation_fraction takes from the end of train (0 with a split of its own)."""
    window, n_train, n_val = data.seq_len + 1, int(train["n_tokens"]), 0
    if int(train.get("vocab_size", 0)) > vocab_size:
        raise ConfigError("model.vocab_size", f"{vocab_size} is smaller than the vocabulary of data.tokenizer "
                                              f"'{data.tokenizer}' ({train['vocab_size']}): set model.vocab_size >= "
                                              f"{train['vocab_size']}")
    if validation is None and data.validation_fraction > 0 and not data.validation_split:
        n_val = int(n_train * data.validation_fraction)
        if n_val < window:
            raise ConfigError("data.validation_fraction",
                              f"{data.validation_fraction} of {n_train:,} tokens is {n_val}, less than one window "
                              f"of data.seq_len + 1 = {window}: raise it, lower data.seq_len, or set it to 0 to "
                              "skip validation")
    for field, split, n in (("data.validation_split", validation, validation and int(validation["n_tokens"])),
                            ("data.dataset", train, n_train - n_val)):
        if split is not None and n < window:
            raise ConfigError(field, f"{n:,} tokens of {split.get('source')} hold no window of data.seq_len + 1 = "
                                     f"{window}: lower data.seq_len or use more data")
    return n_val


@dataclass(frozen=True)
class CacheStatus:
    """Whether the token cache holds everything a run reads."""

    cache_dir: Path
    entries: tuple[CacheEntry, ...]  # "train", then "validation" when data.validation_split names one
    tokenize_in_job: bool  # the job may tokenize what is missing itself (data.tokenize_in_job, or builtin data)

    @property
    def prepared(self) -> bool:
        return all(e.prepared for e in self.entries)

    @property
    def missing(self) -> tuple[CacheEntry, ...]:
        return tuple(e for e in self.entries if not e.prepared)

    def describe(self) -> str:
        return "\n".join(e.describe() for e in self.entries)


def cache_status(data: DataSection, cache_dir: Path | str) -> CacheStatus:
    """Where each split of `data` stands in `cache_dir`: reads no data, takes no lock."""
    cache_dir = Path(cache_dir)
    tokenizer = resolve_tokenizer(data.tokenizer)
    entries = tuple(entry_status(role, source, tokenizer, cache_dir) for role, source in run_sources(data).items())
    return CacheStatus(cache_dir, entries, data.tokenize_in_job or (data.dataset == BUILTIN and len(entries) == 1))


def prepare(data: DataSection, cache_dir: Path | str, *, num_proc: int = 0,
            progress: ProgressSink = None) -> CacheStatus:
    """Tokenize every split of `data` that `cache_dir` lacks on `num_proc` threads (0: every core this
    process may use), shown on `progress`; the status after, `tokenized` where this call did it."""
    if num_proc < 0:
        raise ConfigError("data.num_proc", f"must be >= 0 (0 = every core), got {num_proc}")
    status = cache_status(data, cache_dir)
    entries = []
    for entry in status.entries:
        found = ensure_tokens(entry.source, entry.tokenizer, status.cache_dir, rank=0, num_proc=num_proc,
                              progress=progress, role="slipway prepare")
        entries.append(dataclasses.replace(entry, index=found.index, partial_tokens=0, writer=None, problem=None,
                                           tokenized=found.written))
    return dataclasses.replace(status, entries=tuple(entries))


def main(argv: list[str] | None = None) -> int:
    from common.edge import run_at_edge
    from common.rundir import FAILED_EXIT

    return run_at_edge(lambda: _main(argv), prog="", errors={DataCacheError: FAILED_EXIT})


def _main(argv: list[str] | None) -> int:
    from common.edge import Parser

    parser = Parser(prog="python -m trainer.prepare",
                    description="Tokenize a run's data into its token cache (no GPU, no torch).")
    parser.add_argument("--config", required=True, type=Path, help="runs/RUN/config.yaml (its folder is the run)")
    parser.add_argument("--cpus", type=int, default=None, help="tokenizer threads (default: data.num_proc, "
                        "0 = every core this process may use)")
    parser.add_argument("--check", action="store_true", help="only say whether the cache is prepared (exit 0 if so)")
    args = parser.parse_args(argv)
    try:
        cfg = load_trainer_config(args.config)
        cache_dir = resolve_cache_dir(cfg.data, args.config.resolve().parent)
        if args.check:
            status = cache_status(cfg.data, cache_dir)
            print(status.describe())
            return 0 if status.prepared else 1
        status = prepare(cfg.data, cache_dir, num_proc=cfg.data.num_proc if args.cpus is None else args.cpus)
    except KeyboardInterrupt:
        print("interrupted: run the same command again to continue where it stopped", file=sys.stderr)
        return 130
    print(status.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
