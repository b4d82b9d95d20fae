"""Distributed checkpoints: DCP shards in atomic, pruned step directories (what users see of
them: docs/trainer.md, "Checkpoints").

Layout of `ckpt_dir` (shared by every node):

    step-000100/            a complete checkpoint (only complete ones have this name)
        .metadata           DCP's index of the shards
        __0_0.distcp ...    DCP shards, one or more files per rank
        rank-00000.pt ...   states with `rank_local = True` (RNG streams), one file per rank
        COMPLETE            JSON written last, before the rename: step, world size, time
    .tmp-step-000200/       a save in progress, or the remains of a crash: never loaded

A save writes everything into `.tmp-step-N/`, all ranks meet at a barrier, then rank 0 writes
`COMPLETE` and renames the directory to `step-N/` (then an fsync of the parent). Old checkpoints
are renamed out of the `step-*` namespace before they are deleted (in a thread of their own), so a
half-deleted one is never seen. Saves, loads and the waits for background work run inside
`pause(what)`, the hang watchdog's.

A save is refused before anything is written when a value is not finite on any rank
(`NonFiniteError`: a checkpoint is never a NaN trap to resume into) or when it cannot fit
(`CheckpointWriteError`: the room it needs is the latest checkpoint's size, or the trainer's
estimate before the first); a disk that fills during the write (torch's `unexpected pos 704 vs
598`) becomes the same one-line error.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
import warnings
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from common.errors import ConfigError, human
from trainer.config import CheckpointSection
from common.fs import fsync_dir, write_atomic
from common.rundir import CHECKPOINT_MARKER, SaveLine, checkpoint_complete, complete_checkpoints
from trainer.topology import check_free_space
from trainer.states import local_tensors, nonfinite_names

log = logging.getLogger(__name__)

STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-"
DELETING_PREFIX = ".tmp-deleting-"  # renamed here to be deleted in the background
FORMAT = "slipway-dcp-1"
MODEL_KEY = "model"  # the training loop saves ModelState under this key; export reads it back


class NonFiniteError(RuntimeError):
    """A save that would hold non-finite numbers, or train.max_nonfinite_steps skipped steps in a row."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint that does not fit (refused, or its write failed): the latest complete one stays."""


# -------------------------------------- the directory layout, readable without a process group (hf.py reads it too)


def step_dir(ckpt_dir: Path, step: int) -> Path:
    return Path(ckpt_dir) / f"{STEP_PREFIX}{step:06d}"


def resolve_async_save(setting: bool | str, device: torch.device) -> bool:
    """checkpoint.async_save for `device`: auto is CUDA only (on the CPU staging costs what it saves, and memory)."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


@dataclass
class _Pending:
    """An async save whose shards are still being written."""

    future: Future
    step: int
    tmp: Path
    nbytes: int  # this rank's share, for the diagnosis of a failed write
    started: float  # time.monotonic() at the save's start, for its record (SaveLine)
    step_ms: int


class Checkpointer:
    """Saves and loads `dict[str, Stateful]` at `ckpt_dir/step-NNNNNN/`. Every rank constructs it and
    calls every method (all are collective), in the same order; rank 0 alone touches directory names."""

    def __init__(self, ckpt_dir: Path, cfg: CheckpointSection, expected_bytes: int | None = None,
                 timeout: timedelta | None = None, async_save: Optional[bool] = None,
                 pause: Optional[Callable[[str], AbstractContextManager]] = None, saves: Optional[Path] = None):
        """`expected_bytes`: one checkpoint's size before the first exists (None: no room check
        then). `async_save`: checkpoint.async_save resolved for the device (None: the config's true
        only). `saves`: where rank 0 records each save's duration and size (the warning lead's)."""
        self._saves = saves
        self.dir = Path(ckpt_dir)
        self.cfg = cfg
        self.async_save = cfg.async_save is True if async_save is None else async_save
        self._pause = pause or (lambda what: nullcontext())
        self._deleting: Optional[threading.Thread] = None
        self.expected_bytes = expected_bytes
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        # A group of our own, on gloo: async saves gather plans from a background
        # thread (they must not share a group with the training's collectives),
        # and barriers and small broadcasts then need no accelerator.
        self._pg = dist.new_group(backend="gloo", timeout=timeout) if self.distributed else None
        if not self.distributed:
            quiet_single_process()
        self._pending: _Pending | None = None

    def latest_step(self) -> int | None:
        steps = complete_checkpoints(self.dir)
        return steps[-1] if steps else None

    def load_latest(self, states: dict[str, Any]) -> int:
        """Load the newest complete checkpoint into `states` in place; return its step (0 if none)."""
        with self._pause("the checkpoint load"):
            self._wait_pending()
            step = self._from_rank0(self.latest_step())
            if step is None:
                return 0
            path = step_dir(self.dir, step)
            shared, local = _split(states)
            try:
                if shared:
                    dcp.load(shared, checkpoint_id=path, process_group=self._pg, no_dist=not self.distributed,
                             planner=_LoadPlanner())
            except (Exception, CheckpointException) as exc:  # the latter is a BaseException: DCP's wrapper
                mismatch = _SIZE_MISMATCH.search(str(exc))
                if mismatch is None:
                    raise
                saved, current, name = mismatch.groups()
                raise ConfigError("checkpoint", f"{path} holds {name} of shape {saved}, this model has {current}: "
                                  "resume with the model section it was saved with (one saved before vocabulary "
                                  "padding needs model.pad_vocab_multiple: 1), or start another run") from None
            self._load_rank_local(path, local)
            log.info("loaded checkpoint %s", path)
            return step

    def save(self, step: int, states: dict[str, Any], final: bool = False, step_s: float = 0.0) -> None:
        """Save `states` as checkpoint `step`, never over a complete one. An async save (never `final`)
        shows at the next save or `close()`. `step_s`, the mean step time before it, goes into its record."""
        with self._pause(f"the checkpoint save of step {step}"):
            self._save(step, states, final, time.monotonic(), int(step_s * 1000))

    def _save(self, step: int, states: dict[str, Any], final: bool, started: float, step_ms: int) -> None:
        self._wait_pending()
        shared, local = _split(states)
        # State dicts taken once: checked for non-finite values, then handed to DCP as they are.
        shared = {name: obj.state_dict() if hasattr(obj, "state_dict") else obj for name, obj in shared.items()}
        self._check_finite(step, shared)
        final_path = step_dir(self.dir, step)
        tmp = self.dir / f"{TMP_PREFIX}{final_path.name}"
        status, short = self._from_rank0((_dir_status(final_path), self._room_problem()) if self.rank == 0 else None)
        if status == "complete":
            log.warning("checkpoint %s already exists and is complete; not overwriting it", final_path)
            return
        if short:
            raise CheckpointWriteError(f"not saving checkpoint step {step}: {short}; {self._latest_stays()}")
        if status == "foreign":
            raise RuntimeError(f"{final_path} exists but is not a complete slipway checkpoint (no {CHECKPOINT_MARKER} "
                               "or .metadata inside), so it was not written here: move it away and save again")
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # a crashed save's: out of the way now, deleted in the background
                self._delete_in_background([tmp])
            tmp.mkdir()
        self._barrier()
        nbytes = sum(t.numel() * t.element_size() for _, t in local_tensors(shared))
        with self._full_disk(step, tmp, nbytes):
            self._save_rank_local(tmp, local)
            if self.async_save and not final:
                response = dcp.async_save(shared, checkpoint_id=tmp, process_group=self._pg,
                                          no_dist=not self.distributed)
                future = getattr(response, "upload_completion", response)
                self._pending = _Pending(future, step, tmp, nbytes, started, step_ms)
                return
            dcp.save(shared, checkpoint_id=tmp, process_group=self._pg, no_dist=not self.distributed)
        self._commit(step, tmp, final, started, step_ms)

    def close(self) -> None:
        """Wait for an async save in flight (made visible) and for the pruned checkpoints' deletion."""
        with self._pause("the checkpoint save in flight and the prune"):
            self._wait_pending()
            self._wait_deleting()

    def _check_finite(self, step: int, state: dict[str, Any]) -> None:
        """Raise NonFiniteError on every rank if any rank's shards hold a NaN or an infinity."""
        bad = nonfinite_names(state)
        names = [bad]
        if self.distributed:
            names = [None] * self.world_size
            dist.all_gather_object(names, bad, group=self._pg)
        found = sorted({n for rank_names in names for n in rank_names})
        if found:
            raise NonFiniteError(f"not saving checkpoint step {step}: {', '.join(found[:3])}"
                                 f"{f' and {len(found) - 3} more' if len(found) > 3 else ''} "
                                 f"{'holds' if len(found) == 1 else 'hold'} non-finite values (NaN or inf); "
                                 f"{self._latest_stays()}")

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        with self._full_disk(pending.step, pending.tmp, pending.nbytes):
            pending.future.result()  # re-raises a failed background write; the .tmp dir then stays unused
        self._commit(pending.step, pending.tmp, False, pending.started, pending.step_ms)

    def _room_problem(self) -> str | None:
        """Rank 0: why one more checkpoint would not fit, or None. It needs what the latest one
        took (every save of a run has the same tensors), or the estimate before the first."""
        latest = self.latest_step()
        needed = (sum(f.stat().st_size for f in step_dir(self.dir, latest).iterdir() if f.is_file())
                  if latest is not None else self.expected_bytes)
        if not needed:
            return None
        ok, text = check_free_space(self.dir, needed)
        if not ok and self._deleting is not None:  # an old checkpoint still being deleted: its room counts
            self._wait_deleting()
            ok, text = check_free_space(self.dir, needed)
        return None if ok else text

    def _latest_stays(self) -> str:
        latest = self.latest_step()
        return f"the latest checkpoint stays {step_dir(self.dir, latest) if latest is not None else 'none'}"

    @contextmanager
    def _full_disk(self, step: int, tmp: Path, nbytes: int) -> Iterator[None]:
        """A write that fails on a file system without room for this rank's share is a full disk,
        whatever torch made of the short write: say so in one line. The partial files stay
        until the next save clears them: a rank deleting them here would let the others
        measure the freed space and miss the diagnosis."""
        try:
            yield
        except (Exception, CheckpointException) as exc:  # the latter is a BaseException: DCP's wrapper
            try:
                free: Optional[int] = shutil.disk_usage(self.dir).free
            except OSError:
                free = None
            if free is None or free >= nbytes:
                raise
            raise CheckpointWriteError(
                f"checkpoint step {step} could not be written to {self.dir}: the file system is full ({human(free)} "
                f"free, this rank alone writes {human(nbytes)}): free space there (the partial {tmp.name} can go) "
                f"or set checkpoint.dir elsewhere, then resume; {self._latest_stays()}") from exc

    def _commit(self, step: int, tmp: Path, final: bool, started: float, step_ms: int) -> None:
        """Every rank's files are in `tmp`: rank 0 marks it complete, renames it into place, records it."""
        self._barrier()
        if self.rank == 0:
            meta = {"format": FORMAT, "step": step, "world_size": self.world_size, "final": final,
                    "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__}
            write_atomic(tmp / CHECKPOINT_MARKER, json.dumps(meta, indent=1) + "\n")
            fsync_dir(tmp)
            final_path = step_dir(self.dir, step)
            os.replace(tmp, final_path)
            fsync_dir(self.dir)
            log.info("saved checkpoint %s", final_path)
            if self._saves is not None:
                self._record(step, final_path, started, step_ms)
            self._prune()
        self._barrier()

    def _record(self, step: int, path: Path, started: float, step_ms: int) -> None:
        try:
            nbytes = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
            SaveLine(step, int((time.monotonic() - started) * 1000), nbytes, step_ms,
                     time.strftime("%Y-%m-%dT%H:%M:%S%z")).append_to(self._saves)
        except OSError as exc:  # the lead falls back on its estimate: no reason to stop training
            log.warning("could not record the save of step %d in %s: %s", step, self._saves, exc)

    def _prune(self) -> None:
        """Rank 0: keep the newest `keep_last` checkpoints; older ones and crash leftovers go."""
        for step in complete_checkpoints(self.dir)[:-self.cfg.keep_last]:
            old = step_dir(self.dir, step)
            os.replace(old, self.dir / f"{TMP_PREFIX}old-{old.name}")  # out of the step-* namespace first
        fsync_dir(self.dir)
        self._delete_in_background([e for e in self.dir.iterdir() if e.name.startswith(TMP_PREFIX)
                                    and not e.name.startswith(DELETING_PREFIX)])

    def _delete_in_background(self, entries: list[Path]) -> None:
        """Rank 0: rename `entries` to names no save will ever use (so a save may reuse theirs at
        once), then delete them in a thread, one deleting at a time."""
        doomed = []
        for entry in entries:
            target = self.dir / f"{DELETING_PREFIX}{uuid.uuid4().hex[:8]}-{entry.name}"
            try:
                os.replace(entry, target)
            except FileNotFoundError:
                continue
            doomed.append(target)
        self._wait_deleting()  # the last prune's, if the file system is that slow
        leftovers = [e for e in self.dir.iterdir() if e.name.startswith(DELETING_PREFIX) and e not in doomed]
        doomed += leftovers  # an earlier process's, killed while deleting
        if doomed:
            self._deleting = threading.Thread(target=_delete, args=(doomed,), name="slipway-checkpoint-prune",
                                              daemon=True)
            self._deleting.start()

    def _wait_deleting(self) -> None:
        if self._deleting is not None:
            self._deleting.join()
            self._deleting = None

    def _save_rank_local(self, tmp: Path, local: dict[str, Any]) -> None:
        if not local:
            return
        buffer = io.BytesIO()
        torch.save({name: obj.state_dict() for name, obj in local.items()}, buffer)
        write_atomic(tmp / f"rank-{self.rank:05d}.pt", buffer.getvalue())

    def _load_rank_local(self, path: Path, local: dict[str, Any]) -> None:
        if not local:
            return
        file = path / f"rank-{self.rank:05d}.pt"
        if not file.is_file():
            log.warning("%s has no rank-local state for rank %d (saved with %s ranks?); %s keep their "
                        "current values", path, self.rank, _saved_world_size(path), ", ".join(local))
            return
        payload = torch.load(file, weights_only=False)  # our own file: RNG states are Python tuples
        for name, obj in local.items():
            if name in payload:
                obj.load_state_dict(payload[name])
            else:
                log.warning("%s holds no %r for rank %d; it keeps its current value", file, name, self.rank)

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self._pg)

    def _from_rank0(self, value: Any) -> Any:
        """Rank 0's answer, for decisions every rank must take alike (nodes' file system metadata caches differ)."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._pg)
        return box[0]


_SIZE_MISMATCH = re.compile(r"Size mismatch between saved torch\.Size\((\[[\d, ]*\])\) and current: "
                            r"torch\.Size\((\[[\d, ]*\])\) for ([\w.]+)")


class _LoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's planner, as strict about tensors; a plain value the checkpoint lacks (a counter
    a state object gained after the checkpoint was written) keeps its current value."""

    def create_local_plan(self):
        saved = self.metadata.state_dict_metadata
        for key in [k for k, v in self.state_dict.items() if k not in saved and not isinstance(v, torch.Tensor)]:
            log.info("%s is not in the checkpoint (saved before it existed): it keeps its current value", key)
            del self.state_dict[key]
        return super().create_local_plan()


def _delete(entries: list[Path]) -> None:
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _split(states: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    local = {k: v for k, v in states.items() if getattr(v, "rank_local", False)}
    return {k: v for k, v in states.items() if k not in local}, local


def quiet_single_process() -> None:
    """DCP warns on every call without a process group (async saves from their own thread,
    so a catch_warnings block cannot hold it); one process is a supported layout here."""
    warnings.filterwarnings("ignore", message=r"torch\.distributed is .*single process", category=UserWarning)


def _dir_status(path: Path) -> str:
    return "absent" if not path.exists() else "complete" if checkpoint_complete(path) else "foreign"


def _saved_world_size(path: Path) -> Any:
    try:
        return json.loads((path / CHECKPOINT_MARKER).read_text())["world_size"]
    except (OSError, ValueError, KeyError):
        return "?"
