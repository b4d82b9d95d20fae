"""The trainer's data: tokenized once into a shared cache, cut into windows, sharded by dp rank.

    train, val, vocab_size = build_data(cfg, run_dir, dp_rank, dp_size)
    inputs_BT, targets_BT = train.next_batch()       # torch.long [B, T]
    state = train.state_dict(); train.load_state_dict(state)

Every rank maps the token cache entries `slipway prepare` wrote (trainer/data_cache.py) read-only;
a missing one stops the job, unless `data.tokenize_in_job` (or the builtin corpus) lets rank 0
tokenize it while the other ranks wait.

The token stream is cut into windows of `seq_len + 1` tokens with stride `seq_len` (inputs are a
window's first T tokens, targets its last T). Global sample g is window `perm_e[g % n]` of epoch
`e = g // n`, `perm_e` a permutation of the n windows seeded by `run.seed + e`. A step takes the next
`B * dp_size` global samples (B = micro batch size), dp rank r the contiguous chunk `[r * B, (r + 1) * B)`
of them: so one process with micro batch `B * dp_size` sees exactly rank 0's samples, then rank 1's, in
that order. The state is the number of global samples consumed, which does not depend on dp_size.

Validation is `data.validation_split` when given (a split name; for local files a path), else the last
`data.validation_fraction` of the token stream, held out from training. It is read in order, unshuffled;
the trainer restores its start state before each evaluation, so each scores the same batches.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common import environ
from common.errors import ConfigError
from trainer.config import TrainerConfig
from trainer.data_cache import ensure_tokens, resolve_cache_dir
from trainer.prepare import cache_status, check_tokens

log = logging.getLogger(__name__)


class Sampler:
    """Windows of one token range, in a seeded order per epoch, this dp rank's share of each step."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, shuffle: bool = True, name: str = "train"):
        self.tokens, self.name = tokens, name
        self.seq_len, self.batch_size = seq_len, batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"{name}: {len(tokens)} tokens hold no window of seq_len + 1 = {seq_len + 1}")
        self.consumed_samples = 0
        self._perm: tuple[int, np.ndarray | None] = (-1, None)

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.n_windows

    def _window_ids(self, start: int, count: int) -> np.ndarray:
        """Window ids of global samples [start, start + count), across epoch boundaries."""
        epochs, pos = np.divmod(np.arange(start, start + count), self.n_windows)
        if not self.shuffle:
            return pos
        return np.concatenate([self._permutation(int(e))[pos[epochs == e]] for e in np.unique(epochs)])

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm[0] != epoch:
            gen = torch.Generator().manual_seed((self.seed + epoch) % (1 << 63))
            self._perm = (epoch, torch.randperm(self.n_windows, generator=gen).numpy())
        return self._perm[1]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs_BT, targets_BT) of the next global batch, torch.long on the CPU."""
        first = self.consumed_samples + self.dp_rank * self.batch_size
        ids = self._window_ids(first, self.batch_size)
        offsets_B1 = (ids * self.seq_len)[:, None] + np.arange(self.seq_len + 1)[None, :]
        window_BT1 = torch.from_numpy(self.tokens[offsets_B1].astype(np.int64))
        self.consumed_samples += self.batch_size * self.dp_size
        return window_BT1[:, :-1].contiguous(), window_BT1[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_samples": self.consumed_samples, "epoch": self.epoch, "n_windows": self.n_windows,
                "seq_len": self.seq_len, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("n_windows", "seq_len", "seed"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"{self.name} data state was saved with {key}={state[key]}, this run has "
                                 f"{getattr(self, key)}: the data or config changed since the checkpoint, so "
                                 "resuming would not replay the same samples")
        self.consumed_samples = int(state["consumed_samples"])


def build_data(cfg: TrainerConfig, run_dir: Path, dp_rank: int, dp_size: int) -> tuple[Sampler, Sampler | None, int]:
    """(train sampler, validation sampler or None, tokenizer vocabulary size) for this dp rank."""
    data, batch = cfg.data, cfg.train.micro_batch_size
    rank0 = (environ.count("RANK") or 0) == 0
    status = cache_status(data, resolve_cache_dir(data, run_dir))
    if not status.prepared:
        if not status.tokenize_in_job:
            raise ConfigError("data.tokenize_in_job", "the token cache is not prepared for this run: run `slipway "
                              "prepare CONFIG` before submitting (or `slipway submit CONFIG --prepare`), or set "
                              "data.tokenize_in_job: true to let rank 0 tokenize it while the other ranks wait; "
                              + "; ".join(e.describe() for e in status.missing))
        if rank0:
            (log.info if data.dataset == "builtin" else log.warning)(
                "the token cache lacks %s: rank 0 tokenizes it now while the other ranks wait "
                "(`slipway prepare CONFIG` does this before the allocation)",
                " and ".join(e.source.description for e in status.missing))
    files = {e.role: ensure_tokens(e.source, e.tokenizer, status.cache_dir, num_proc=data.num_proc)
             for e in status.entries}
    for f in files.values():
        if rank0 and not f.written:
            log.info("opened the token cache %s: %s tokens of %s, prepared by %s at %s", f.path,
                     f"{f.index['n_tokens']:,}", f.index["source"], f.index.get("prepared_by") or "an earlier slipway",
                     f.index.get("created", "?"))
    train, split = files["train"], files.get("validation")

    def counted(f):  # what the cache's index says, as the tokens mapped count it
        return {**f.index, "n_tokens": len(f.tokens)}

    n_val = check_tokens(data, cfg.model.vocab_size, counted(train), counted(split) if split else None)
    train_tokens, val_tokens = (train.tokens[:-n_val], train.tokens[-n_val:]) if n_val else (
        train.tokens, split.tokens if split else None)
    train_sampler = Sampler(train_tokens, data.seq_len, batch, dp_rank, dp_size, seed=cfg.run.seed)
    val_sampler = None if val_tokens is None else Sampler(val_tokens, data.seq_len, batch, dp_rank, dp_size,
                                                          shuffle=False, name="validation")
    if rank0:
        log.info("%s; train %s windows, validation %s; tokens %s", train.index["source"],
                 f"{train_sampler.n_windows:,}", f"{val_sampler.n_windows:,} windows" if val_sampler else "none",
                 train.path)
    return train_sampler, val_sampler, int(train.index["vocab_size"])


