"""Distributed checkpoints: exact round trips, pruning, atomicity under SIGKILL, resharding.

The file doubles as the worker script of its multi-process tests:
`python -m torch.distributed.run --nproc-per-node 2 tests/test_trainer_checkpoint.py MODE DIR`
and `python tests/test_trainer_checkpoint.py slow-save DIR`.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # when run as a worker script
    sys.path.insert(0, str(ROOT))

from common.rundir import complete_checkpoints

from trainer.checkpoint import Checkpointer, CheckpointWriteError, step_dir  # noqa: E402
from trainer.states import ModelState, OptimizerState, RNGState  # noqa: E402
from trainer.config import CheckpointSection

VOCAB, DIM = 32, 16


# --------------------------------------------------------------------------
# A stand-in with the trainer model's names (the checkpointer knows no model).
# --------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.feed_forward = nn.ModuleDict({w: nn.Linear(DIM, DIM, bias=False) for w in ("w1", "w2", "w3")})

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        ff = self.feed_forward
        h = self.attention_norm(x_BTD)
        return x_BTD + ff["w2"](nn.functional.silu(ff["w1"](h)) * ff["w3"](h))


class Tiny(nn.Module):
    def __init__(self, num_layers: int = 2, tie: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(num_layers)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens_BT)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


class DataPosition:
    """A data-sampler-like Stateful holding non-tensor state."""

    def __init__(self) -> None:
        self.epoch, self.index, self.order = 0, 0, [3, 1, 2]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "order": list(self.order)}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.index, self.order = sd["epoch"], sd["index"], list(sd["order"])


def train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, 5), generator=g)
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()


def make(seed: int = 0, tie: bool = False, lr: float = 1e-2):
    torch.manual_seed(seed)
    model = Tiny(tie=tie)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def states_of(model, opt, sched, data=None, rng=True) -> dict:
    states = {"model": ModelState(model), "optimizer": OptimizerState(model, opt), "lr_scheduler": sched}
    if data is not None:
        states["data"] = data
    if rng:
        states["rng"] = RNGState()
    return states


def snapshot(model, opt) -> dict:
    """Model and flattened optimizer state, cloned (what must come back exactly)."""
    out = {}
    parts = {"model": ModelState(model), "optimizer": OptimizerState(model, opt)}
    for key, state in parts.items():
        for name, value in state.state_dict().items():
            out[f"{key}.{name}"] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def next_randoms() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def ckpt_cfg(**kw) -> CheckpointSection:
    return CheckpointSection(**{"keep_last": 2, **kw})


# --------------------------------------------------------------------------
# Single process.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True])
def test_round_trip_restores_everything_exactly(tmp_path, async_save):
    model, opt, sched = make(seed=0, tie=True)
    data = DataPosition()
    for step in (1, 2):
        train_step(model, opt, seed=step)
        sched.step()
    data.epoch, data.index, data.order = 1, 7, [2, 3, 1]
    random.seed(5), np.random.seed(5), torch.manual_seed(5)

    ck = Checkpointer(tmp_path, ckpt_cfg(async_save=async_save))
    ck.save(2, states_of(model, opt, sched, data))
    expected, expected_sched = snapshot(model, opt), sched.state_dict()
    expected_randoms = next_randoms()
    train_step(model, opt, seed=3)  # what training does next, from the saved point
    after_one_more = snapshot(model, opt)
    ck.close()
    assert ck.latest_step() == 2

    model2, opt2, sched2 = make(seed=1, tie=True)
    data2 = DataPosition()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    step = Checkpointer(tmp_path, ckpt_cfg()).load_latest(states_of(model2, opt2, sched2, data2))
    assert step == 2
    assert next_randoms() == expected_randoms
    assert_same(snapshot(model2, opt2), expected)
    assert sched2.state_dict() == expected_sched and sched2.get_last_lr() == sched.get_last_lr()
    assert data2.state_dict() == {"epoch": 1, "index": 7, "order": [2, 3, 1]}
    assert model2.output.weight is model2.tok_embeddings.weight  # the tie survives loading
    train_step(model2, opt2, seed=3)
    assert_same(snapshot(model2, opt2), after_one_more)


@pytest.mark.parametrize("async_save", [False, True])
def test_every_save_records_its_duration_size_and_the_step_time(tmp_path, async_save):
    """saves.log, which the batch script's warning lead reads (an async save's writing counted)."""
    from common.rundir import SaveLine
    from trainer.preflight import check_write_speed

    model, opt, sched = make(seed=0)
    saves = tmp_path / "saves.log"
    ck = Checkpointer(tmp_path / "ckpt", ckpt_cfg(async_save=async_save), saves=saves)
    ck.save(1, states_of(model, opt, sched), step_s=0.25)
    ck.save(2, states_of(model, opt, sched), step_s=0.5)
    ck.close()
    records = [SaveLine.parse(line) for line in saves.read_text().splitlines()]
    assert [(r.step, r.step_ms) for r in records] == [(1, 250), (2, 500)]
    for r in records:
        assert r.bytes == sum(f.stat().st_size for f in step_dir(tmp_path / "ckpt", r.step).iterdir()) and r.ms >= 0
    ok, text = check_write_speed(tmp_path / "ckpt", 8 << 20, seconds=0.5)  # the preflight's estimate before any
    assert ok and int(text.rsplit("write_bps=", 1)[1]) > 0 and not list((tmp_path / "ckpt").glob(".preflight-*"))


def test_trainer_model_round_trip(tmp_path):
    """The real Transformer: weights only (rotary tables are recomputed, never saved), tie intact."""
    from trainer.config import ModelSection
    from trainer.model import Transformer

    cfg = ModelSection(size="custom", hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                       num_kv_heads=2, vocab_size=40, max_position_embeddings=8, tie_embeddings=True)
    model = Transformer(cfg)
    Checkpointer(tmp_path, ckpt_cfg()).save(1, {"model": ModelState(model)})
    other = Transformer(cfg)
    other.init_weights(seed=1)
    assert Checkpointer(tmp_path, ckpt_cfg()).load_latest({"model": ModelState(other)}) == 1
    assert_same(other.state_dict(), model.state_dict())
    assert other.output.weight is other.tok_embeddings.weight
    assert "rope_cos" not in ModelState(model).state_dict()


def test_empty_dir_loads_nothing(tmp_path):
    model, opt, sched = make()
    before = snapshot(model, opt)
    ck = Checkpointer(tmp_path / "missing", ckpt_cfg())
    assert ck.latest_step() is None
    assert ck.load_latest({"model": ModelState(model)}) == 0
    assert_same(snapshot(model, opt), before)


def test_save_initial_keeps_a_fresh_optimizer_fresh(tmp_path):
    """save(0) before any step must not advance Adam's step counter (bias correction)."""
    model, opt, sched = make(seed=0)
    reference, ref_opt, _ = make(seed=0)
    Checkpointer(tmp_path, ckpt_cfg()).save(0, states_of(model, opt, sched))
    assert complete_checkpoints(tmp_path) == [0]
    train_step(model, opt, seed=1)
    train_step(reference, ref_opt, seed=1)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_keep_last_prunes_and_never_overwrites(tmp_path, caplog):
    model, opt, sched = make()
    ck = Checkpointer(tmp_path, ckpt_cfg(keep_last=2))
    for step in (0, 5, 10, 15):
        train_step(model, opt, seed=step)
        ck.save(step, states_of(model, opt, sched))
    assert complete_checkpoints(tmp_path) == [10, 15]
    ck.close()  # the pruned ones are deleted in the background: done by now
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000010", "step-000015"]
    meta = json.loads((step_dir(tmp_path, 15) / "COMPLETE").read_text())
    assert meta["step"] == 15 and meta["world_size"] == 1

    marker = step_dir(tmp_path, 15) / "COMPLETE"
    before = marker.stat().st_mtime_ns
    ck.save(15, states_of(model, opt, sched))
    assert "already exists" in caplog.text and marker.stat().st_mtime_ns == before

    (tmp_path / "step-000020").mkdir()  # not ours: refuse clearly rather than clobber or skip
    with pytest.raises(RuntimeError, match="step-000020 exists but is not a complete"):
        ck.save(20, states_of(model, opt, sched))
    assert ck.latest_step() == 15


def test_pruned_checkpoints_are_deleted_off_the_save_path(tmp_path, monkeypatch):
    """A slow file system's deleting does not hold the save up: the pruned checkpoint (and a
    crashed save's leftover) leave the step-* namespace at once and are deleted in a thread;
    the next prune and close() wait for it. Every piece of checkpoint work runs in `pause`."""
    import threading

    import trainer.checkpoint as ckpt_mod

    release, deleting = threading.Event(), []
    real_rmtree = shutil.rmtree

    def slow_rmtree(path, *args, **kwargs):
        deleting.append(Path(path).name)
        release.wait(30)
        return real_rmtree(path, *args, **kwargs)

    paused: list[str] = []

    class Pause:
        def __init__(self, what: str):
            paused.append(what)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    model, opt, sched = make()
    ck = Checkpointer(tmp_path, ckpt_cfg(keep_last=1), pause=Pause)
    ck.save(1, states_of(model, opt, sched))
    (tmp_path / ".tmp-step-000003").mkdir()  # a crashed save of step 3 left this
    (tmp_path / ".tmp-step-000003" / "__0_0.distcp").write_bytes(b"half")
    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", slow_rmtree)
    train_step(model, opt, seed=2)
    ck.save(2, states_of(model, opt, sched))  # prunes step 1: its deleting blocks, the save does not
    assert complete_checkpoints(tmp_path) == [2] and not release.is_set()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n for n in names if not n.startswith(".tmp-deleting-")] == ["step-000002"], names
    assert any(n.endswith("-.tmp-old-step-000001") for n in names), names
    assert any(n.endswith("-.tmp-step-000003") for n in names), names  # renamed aside: step 3's name is free
    train_step(model, opt, seed=3)
    saver = threading.Thread(target=ck.save, args=(3, states_of(model, opt, sched)))
    saver.start()  # reuses step 3's temporary name at once; its prune waits for the first deleting
    saver.join(1.0)
    assert saver.is_alive() and deleting, deleting
    release.set()
    saver.join(30)
    ck.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003"]
    assert paused == ["the checkpoint save of step 1", "the checkpoint save of step 2", "the checkpoint save of step 3",
                      "the checkpoint save in flight and the prune"]
    model2, opt2, sched2 = make(seed=5)
    assert Checkpointer(tmp_path, ckpt_cfg(), pause=Pause).load_latest(states_of(model2, opt2, sched2)) == 3
    assert paused[-1] == "the checkpoint load"
    assert_same(snapshot(model2, opt2), snapshot(model, opt))


def test_async_save_is_visible_only_once_finished(tmp_path):
    model, opt, sched = make()
    ck = Checkpointer(tmp_path, ckpt_cfg(async_save=True))
    ck.save(1, states_of(model, opt, sched))
    assert ck.latest_step() is None  # committed by the next save or close()
    train_step(model, opt, seed=1)
    expected = snapshot(model, opt)
    ck.save(2, states_of(model, opt, sched))
    assert ck.latest_step() == 1
    with torch.no_grad():  # training goes on while the files are written: the staged copy is unaffected
        for p in model.parameters():
            p.add_(1.0)
    ck.close()
    assert complete_checkpoints(tmp_path) == [1, 2]
    model2, opt2, sched2 = make(seed=3)
    assert Checkpointer(tmp_path, ckpt_cfg()).load_latest(states_of(model2, opt2, sched2)) == 2
    assert_same(snapshot(model2, opt2), expected)


def test_final_save_is_synchronous(tmp_path):
    model, opt, sched = make()
    ck = Checkpointer(tmp_path, ckpt_cfg(async_save=True))
    ck.save(3, states_of(model, opt, sched), final=True)
    assert ck.latest_step() == 3
    assert json.loads((step_dir(tmp_path, 3) / "COMPLETE").read_text())["final"] is True


@pytest.mark.slow
def test_sigkill_during_save_leaves_previous_checkpoint_intact(tmp_path):
    ready = tmp_path / "writing"
    proc = subprocess.Popen([sys.executable, __file__, "slow-save", str(tmp_path)], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"worker did not reach the slow save:\n{proc.communicate()[0].decode()}")
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    partial = tmp_path / "ckpt" / ".tmp-step-000002"
    assert any(partial.glob("*.distcp")) and not (partial / "COMPLETE").exists()
    assert not step_dir(tmp_path / "ckpt", 2).exists()
    ck = Checkpointer(tmp_path / "ckpt", ckpt_cfg())
    assert ck.latest_step() == 1

    model2, opt2, sched2 = make(seed=7)
    assert ck.load_latest(states_of(model2, opt2, sched2, rng=False)) == 1
    assert_same(snapshot(model2, opt2), torch.load(tmp_path / "step1.pt"))

    ck.save(3, states_of(model2, opt2, sched2, rng=False))  # a successful save cleans the leftover
    assert not partial.exists() and complete_checkpoints(tmp_path / "ckpt") == [1, 3]


def _slow_save_worker(root: Path) -> None:
    """Save step 1, then hang inside step 2's write (after the shards, before .metadata)."""
    from torch.distributed.checkpoint import FileSystemWriter

    ck = Checkpointer(root / "ckpt", ckpt_cfg())
    model, opt, sched = make(seed=0)
    train_step(model, opt, seed=1)
    ck.save(1, states_of(model, opt, sched, rng=False))
    torch.save(snapshot(model, opt), root / "step1.pt")
    original = FileSystemWriter.write_data

    def write_then_hang(self, plan, planner):
        fut = original(self, plan, planner)
        fut.wait()
        (root / "writing").touch()
        time.sleep(600)
        return fut

    FileSystemWriter.write_data = write_then_hang
    train_step(model, opt, seed=2)
    ck.save(2, states_of(model, opt, sched, rng=False))


# --------------------------------------------------------------------------
# Two processes (gloo): save in one layout, load in another.
# --------------------------------------------------------------------------


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    return env


def _torchrun(mode: str, root: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           __file__, mode, str(root)]
    result = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"


@pytest.mark.multiproc
def test_reshard_fsdp2_tp_and_pipeline_stages(tmp_path):
    """1 process saves -> 2-rank FSDP2 loads and trains, saves async -> 2-rank TP loads, saves
    -> 1 process loads (each); 2 pipeline-like stages (each rank holds some layers) save -> 1 process loads the full model."""
    model, opt, sched = make(seed=0)
    train_step(model, opt, seed=1)
    Checkpointer(tmp_path / "fsdp", ckpt_cfg()).save(1, states_of(model, opt, sched, rng=False))
    torch.save(snapshot(model, opt), tmp_path / "ref1.pt")

    _torchrun("fsdp", tmp_path)

    model2, opt2, sched2 = make(seed=5)
    assert Checkpointer(tmp_path / "fsdp", ckpt_cfg()).load_latest(states_of(model2, opt2, sched2, rng=False)) == 2
    assert_same(snapshot(model2, opt2), torch.load(tmp_path / "ref2.pt"))
    assert sched2.last_epoch == 1

    model4, opt4, sched4 = make(seed=8)
    assert Checkpointer(tmp_path / "tp", ckpt_cfg()).load_latest(states_of(model4, opt4, sched4, rng=False)) == 3
    assert_same(snapshot(model4, opt4), torch.load(tmp_path / "ref2.pt"))

    model3, opt3, sched3 = make(seed=6)
    assert Checkpointer(tmp_path / "pp", ckpt_cfg()).load_latest(states_of(model3, opt3, sched3, rng=False)) == 4
    stages = {**torch.load(tmp_path / "stage0.pt"), **torch.load(tmp_path / "stage1.pt")}
    assert_same(snapshot(model3, opt3), stages)


def _full(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The whole model and optimizer state gathered from shards (rank 0 gets it), like `snapshot`."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    full_opts = StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True)
    out = {f"model.{k}": v for k, v in get_model_state_dict(model, options=full_opts).items()}
    out.update({f"optimizer.{k}": v for k, v in get_optimizer_state_dict(model, opt, options=full_opts).items()})
    return out


def _fsdp_worker(root: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rank = dist.get_rank()
    model, opt, sched = make(seed=10 + rank)  # wrong weights on purpose: loading must fix them
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ck = Checkpointer(root / "fsdp", ckpt_cfg(async_save=True))
    assert ck.load_latest(states_of(model, opt, sched, rng=False)) == 1

    got = _full(model, opt)
    if rank == 0:
        assert_same(got, torch.load(root / "ref1.pt"))
    train_step(model, opt, seed=20 + rank)  # each rank its own batch, as data parallelism does
    sched.step()
    random.seed(100 + rank), np.random.seed(100 + rank), torch.manual_seed(100 + rank)
    ck.save(2, states_of(model, opt, sched))
    expected_randoms = next_randoms()
    got = _full(model, opt)
    if rank == 0:
        torch.save(got, root / "ref2.pt")
    ck.close()
    random.seed(0), np.random.seed(0), torch.manual_seed(0)  # the same on both ranks now
    assert ck.load_latest({"rng": RNGState()}) == 2
    assert next_randoms() == expected_randoms, f"rank {rank} did not get its own RNG streams back"

    # Tensor parallel (DTensor shards of w1/w3 by rows, w2 by columns) loads what FSDP2 saved,
    # then saves it again for the single process to load.
    model, _, _ = make(seed=30)
    plan = {f"layers.{i}.feed_forward.{w}": RowwiseParallel() if w == "w2" else ColwiseParallel()
            for i in range(2) for w in ("w1", "w2", "w3")}
    parallelize_module(model, init_device_mesh("cpu", (2,)), plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    assert Checkpointer(root / "fsdp", ckpt_cfg()).load_latest(states_of(model, opt, sched, rng=False)) == 2
    got = _full(model, opt)
    if rank == 0:
        assert_same(got, torch.load(root / "ref2.pt"))
    Checkpointer(root / "tp", ckpt_cfg()).save(3, states_of(model, opt, sched, rng=False))

    # Pipeline-like: rank 0 holds the embeddings and layer 0, rank 1 layer 1 and the head,
    # under the full model's names; each has its own optimizer over what it holds.
    model, _, _ = make(seed=0)
    drop = ("1", "norm", "output") if rank == 0 else ("0", "tok_embeddings")
    for name in drop:
        if name in model.layers:
            del model.layers[name]
        else:
            delattr(model, name)
    stage_opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sum(p.square().sum() for p in model.parameters()).backward()
    stage_opt.step()
    stage_opt.zero_grad()
    sched = torch.optim.lr_scheduler.LambdaLR(stage_opt, lambda s: 1.0 / (1 + s))
    Checkpointer(root / "pp", ckpt_cfg()).save(4, states_of(model, stage_opt, sched, rng=False))
    torch.save(snapshot(model, stage_opt), root / f"stage{rank}.pt")


# --------------------------------------------------------------------------
# Checkpoints written before a change of the trainer.
# --------------------------------------------------------------------------


class _OldTrainState:
    """trainer.train.TrainState as it was before non-finite steps were counted."""

    def __init__(self, step: int) -> None:
        self.step = step

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]


def test_a_state_gaining_a_counter_still_loads_older_checkpoints(tmp_path):
    from trainer.loop import TrainState

    model, opt, sched = make()
    Checkpointer(tmp_path, ckpt_cfg()).save(5, {**states_of(model, opt, sched), "train_state": _OldTrainState(5)})
    state = TrainState()  # a fresh process resuming: the counters it lacks stay at their start values
    model2, opt2, sched2 = make(seed=3)
    assert Checkpointer(tmp_path, ckpt_cfg()).load_latest({**states_of(model2, opt2, sched2),
                                                           "train_state": state}) == 5
    assert (state.step, state.skipped_steps, state.nonfinite_streak) == (5, 0, 0)
    assert_same(snapshot(model2, opt2), snapshot(model, opt))  # tensors: as strict as ever


def test_a_checkpoint_of_other_dimensions_is_a_config_error(tmp_path):
    """A checkpoint saved before vocabulary padding (or of another model) says what to do."""
    from common.errors import ConfigError
    from trainer.config import ModelSection
    from trainer.model import Transformer

    dims = dict(size="custom", hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4, num_kv_heads=2,
                vocab_size=40, max_position_embeddings=8)
    Checkpointer(tmp_path, ckpt_cfg()).save(1, {"model": ModelState(Transformer(ModelSection(**dims,
                                                                                            pad_vocab_multiple=1)))})
    padded = Transformer(ModelSection(**dims))  # 40 -> 64 rows
    with pytest.raises(ConfigError, match=r"^checkpoint: .*step-000001 holds model\.tok_embeddings\.weight of shape "
                                          r"\[40, 16\], this model has \[64, 16\]: .*model\.pad_vocab_multiple: 1"):
        Checkpointer(tmp_path, ckpt_cfg()).load_latest({"model": ModelState(padded)})


# --------------------------------------------------------------------------
# A full disk: a real tmpfs of a chosen size, mounted in a private mount namespace.
# --------------------------------------------------------------------------


def _small_fs_reason() -> str | None:
    if os.geteuid() != 0:
        return "mounting a small tmpfs needs root (a private mount namespace)"
    if not shutil.which("unshare"):
        return "needs unshare (util-linux)"
    return None


def on_small_fs(mountpoint: Path, size: int, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run `cmd` with a tmpfs of `size` bytes at `mountpoint`, seen by `cmd` and its children only."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    script = 'mount -t tmpfs -o size="$1" slipway-test "$2" && shift 2 && exec "$@"'
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh",
                           str(size), str(mountpoint), *cmd], capture_output=True, text=True, timeout=300, check=False, **kwargs)


def _disk_bytes(path: Path) -> int:
    """What `path`'s files take on a tmpfs: whole pages."""
    return sum(-(-f.stat().st_size // 4096) * 4096 for f in path.rglob("*") if f.is_file())


@pytest.mark.skipif(_small_fs_reason() is not None, reason=str(_small_fs_reason()))
@pytest.mark.slow
def test_a_checkpoint_that_cannot_fit_is_one_line_and_the_last_one_stays(tmp_path):
    """Room for one checkpoint: the first is saved; the second is refused before a byte is written
    (it needs what the first took), naming the directory and the fix. With no estimate of the first
    one, its write fails for real on the full disk (sync and async), and torch's cryptic short-write
    error becomes the same kind of line."""
    model, opt, sched = make(seed=0)
    Checkpointer(tmp_path / "probe", ckpt_cfg()).save(1, states_of(model, opt, sched, rng=False))
    one = _disk_bytes(step_dir(tmp_path / "probe", 1))
    proc = on_small_fs(tmp_path / "small", one + one // 2, [sys.executable, __file__, "full-disk", str(tmp_path)],
                       env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = json.loads(proc.stdout.splitlines()[-1])
    small = tmp_path / "small"
    size = r"[0-9.]+ (?:B|[KMGT]iB)"  # common/errors.py's `human`
    assert re.fullmatch(rf"not saving checkpoint step 2: {size} free at {re.escape(str(small / 'ckpt'))} "
                        rf"\(where checkpoints go\), one checkpoint needs about {size}: free space there or set "
                        rf"checkpoint\.dir elsewhere; the latest checkpoint stays {re.escape(str(small / 'ckpt'))}/"
                        r"step-000001", said["refused"]), said["refused"]
    assert said["after_refusal"] == ["step-000001"]  # nothing of step 2 was started
    for mode in ("sync", "async"):
        where = re.escape(str(small / mode))
        assert re.fullmatch(rf"checkpoint step 1 could not be written to {where}: the file system is full "
                            rf"\({size} free, this rank alone writes {size}\): free space there \(the "
                            r"partial \.tmp-step-000001 can go\) or set checkpoint\.dir elsewhere, then resume; the "
                            r"latest checkpoint stays none", said[mode]), said[mode]
        assert said[f"{mode}_steps"] == []


@pytest.mark.multiproc
@pytest.mark.skipif(_small_fs_reason() is not None, reason=str(_small_fs_reason()))
def test_slipway_local_stops_at_a_checkpoint_that_cannot_fit(tmp_path):
    """The user's command: `slipway local tiny_cpu` (2 ranks) with checkpoint.dir on a 4 MiB file system.
    The first save is refused from the model's size (12.8 MiB), before a byte is written: one
    error line (not one per rank, no traceback of ours), exit 1, the trained steps in metrics."""
    from trainer_helpers import clean_env

    project = tmp_path / "project"
    (project / "configs").mkdir(parents=True)
    shutil.copy(ROOT / "configs" / "tiny_cpu.yaml", project / "configs")
    small = tmp_path / "small"
    proc = on_small_fs(small, 4 * 2**20, [sys.executable, "-m", "jobs", "local", "tiny_cpu", "train.steps=4",
                                          "logging.interval=1", "checkpoint.interval=2", f"checkpoint.dir={small / 'ckpt'}"],
                       cwd=project, env=clean_env(SLIPWAY_PROJECT=str(project)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert errors == [(f"error: not saving checkpoint step 2: 4.0 MiB free at {small} (where checkpoints go), one "
                       "checkpoint needs about 12.8 MiB: free space there or set checkpoint.dir elsewhere; the latest "
                       "checkpoint stays none")], out
    assert "CheckpointWriteError" not in out and not re.search(r"^\[rank\d+\]: Traceback", out, re.MULTILINE), out
    run = project / "runs" / "tiny_cpu"
    assert [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r.get("kind") == "train"] == [1, 2], out
    # the reason again as the last line, below torchrun's report of the failed ranks
    assert out.strip().splitlines()[-1].startswith(f"training failed with exit code 1: {errors[0][7:]}; log: "), out
    assert not list(run.glob("checkpoints*"))


def _full_disk_worker(root: Path) -> None:
    """Inside on_small_fs (a tmpfs at root/small): print what each save said, as JSON."""
    small, said = root / "small", {}
    model, opt, sched = make(seed=0)
    ck = Checkpointer(small / "ckpt", ckpt_cfg(), expected_bytes=1)
    ck.save(1, states_of(model, opt, sched, rng=False))
    train_step(model, opt, seed=2)
    try:
        ck.save(2, states_of(model, opt, sched, rng=False))
    except CheckpointWriteError as exc:
        said["refused"] = str(exc)
    said["after_refusal"] = sorted(p.name for p in (small / "ckpt").iterdir())
    # What is left is too small for another checkpoint; without an estimate the first save tries.
    for mode in ("sync", "async"):
        ck = Checkpointer(small / mode, ckpt_cfg(async_save=mode == "async"))
        try:
            ck.save(1, states_of(model, opt, sched, rng=False))
            ck.close()
        except CheckpointWriteError as exc:
            said[mode] = str(exc)
        said[f"{mode}_steps"] = complete_checkpoints(small / mode)
    print(json.dumps(said))


if __name__ == "__main__":
    mode, where = sys.argv[1], Path(sys.argv[2])
    if mode == "slow-save":
        _slow_save_worker(where)
    elif mode == "full-disk":
        _full_disk_worker(where)
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        try:
            {"fsdp": _fsdp_worker}[mode](where)
        finally:
            dist.destroy_process_group()


def test_a_save_short_of_room_waits_for_the_old_checkpoint_being_deleted(tmp_path, monkeypatch):
    """The prune deletes off the step's path: a save on a tight quota that finds too little room
    while an old checkpoint is still being deleted waits for that room, and is not refused."""
    import threading

    import trainer.checkpoint as ckpt_mod

    model, opt, sched = make()
    ck = Checkpointer(tmp_path, ckpt_cfg(keep_last=1), expected_bytes=1)
    deleting = threading.Event()
    ck._deleting = threading.Thread(target=deleting.wait, args=(30,))
    ck._deleting.start()
    asked: list[bool] = []

    def free_space(path, needed):
        asked.append(deleting.is_set())
        return deleting.is_set(), "the disk is full"  # room once the old checkpoint is gone

    monkeypatch.setattr(ckpt_mod, "check_free_space", free_space)
    threading.Timer(0.5, deleting.set).start()
    ck.save(1, states_of(model, opt, sched))
    ck.close()
    assert asked == [False, True] and complete_checkpoints(tmp_path) == [1]
