"""Non-finite numbers are never trained on nor saved.

A NaN is forced two ways: the issue's absurd learning rate (train.lr=1e30:
the first update leaves weights whose next gradients are NaN), and a loss
poisoned on one step of one rank (tests/trainer_helpers.py `poison_loss`).
Every checkpoint left behind is read back whole and must be finite.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from common.rundir import complete_checkpoints

from trainer.checkpoint import step_dir
from common.rundir import NONFINITE_EXIT
from trainer.train import main
from trainer_helpers import POISON_ENV, clean_env, poison_loss, synthetic_data, tiny_config, torchrun, write_run

# fp32 on CPU, 8 steps of the tiny model: layouts agree to ~2e-7 (see test_trainer_parallel).
LOSS_RTOL = 1e-5


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_checkpoints_finite(ckpt_dir: Path) -> list[int]:
    """Every tensor of every complete checkpoint (model and optimizer state) is finite."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    steps = complete_checkpoints(ckpt_dir)
    for step in steps:
        path = step_dir(ckpt_dir, step)
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
        tensors = {name: torch.empty(md.size, dtype=md.properties.dtype)
                   for name, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
        assert any(n.startswith("optimizer.") for n in tensors) or step == 0 or not tensors
        dcp.load(tensors, checkpoint_id=path, no_dist=True)
        for name, value in tensors.items():
            if value.is_floating_point():
                assert torch.isfinite(value).all(), f"{path.name}: {name} is not finite"
    return steps


@pytest.mark.slow
def test_absurd_lr_stops_with_exit_3_and_saves_nothing_non_finite(tmp_path, capsys):
    """The issue's reproduction: lr 1e30 used to train on at loss nan and exit 0."""
    cfg = tiny_config(train={"lr": 1e30, "min_lr": 0.0, "max_nonfinite_steps": 3},
                      checkpoint={"interval": 1, "keep_last": 2, "save_initial": True})
    config = write_run(tmp_path, "absurd", cfg)
    assert main(["--config", str(config)], data=synthetic_data) == NONFINITE_EXIT
    captured = capsys.readouterr()
    console = [line for line in captured.out.splitlines() if line.startswith("step ")]
    assert console[0].startswith("step 1/8 loss ") and " eta " in console[0]  # step/total and the ETA
    assert console[-1].startswith("step 3/8 loss ") and console[-1].endswith("skipped 2")
    err = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "3 steps in a row (to step 4)" in err[0] and "train.max_nonfinite_steps=3" in err[0]

    history = records(config.parent)
    skipped = [r for r in history if r["kind"] == "nonfinite"]
    assert [(r["step"], r["in_a_row"]) for r in skipped] == [(2, 1), (3, 2), (4, 3)]
    assert skipped[0]["grad_norm"] is None  # NaN is written as JSON null, never as a bare NaN
    trained = [r for r in history if r["kind"] == "train"]
    assert [r["skipped_steps"] for r in trained] == [0, 1, 2]
    assert "NaN" not in (config.parent / "metrics.jsonl").read_text()
    # Saved before the first bad step (0 and 1); none of the skipped steps rotated them out.
    assert assert_checkpoints_finite(config.parent / "checkpoints") == [0, 1]


def _train_poisoned(config: Path, step: int) -> int:
    restore = poison_loss(step=step, rank=0, accum=4)
    try:
        return main(["--config", str(config)], data=synthetic_data)
    finally:
        restore()


@pytest.mark.slow
def test_a_poisoned_step_is_skipped_and_training_goes_on(tmp_path):
    """A NaN loss on step 3 of 8: no update, the interval save due at step 3 waits for step 4,
    and the run ends normally with finite losses and checkpoints."""
    config = write_run(tmp_path, "poisoned", tiny_config(checkpoint={"interval": 3, "keep_last": 5}))
    assert _train_poisoned(config, step=3) == 0
    history = records(config.parent)
    trained = {r["step"]: r for r in history if r["kind"] == "train"}
    assert trained[3]["loss"] is None and trained[3]["skipped_steps"] == 1 and trained[8]["skipped_steps"] == 1
    assert all(math.isfinite(trained[s]["loss"]) for s in (1, 2, 4, 5, 6, 7, 8))
    assert [r["step"] for r in history if r["kind"] == "nonfinite"] == [3]
    assert assert_checkpoints_finite(config.parent / "checkpoints") == [4, 6, 8]


@pytest.mark.slow
def test_a_skipped_step_changes_no_weight_and_no_optimizer_state(tmp_path):
    """Step 3 of 3 poisoned: its final checkpoint (finals are not deferred) holds exactly the
    weights and AdamW moments of step 2; only the step count and data position moved on."""
    config = write_run(tmp_path, "last", tiny_config(train={"steps": 3}, checkpoint={"interval": 1, "keep_last": 5}))
    assert _train_poisoned(config, step=3) == 0
    ckpt = config.parent / "checkpoints"
    assert assert_checkpoints_finite(ckpt) == [1, 2, 3]
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    def tensors(step: int) -> dict[str, torch.Tensor]:
        path = step_dir(ckpt, step)
        md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        out = {n: torch.empty(m.size, dtype=m.properties.dtype) for n, m in md.items()
               if isinstance(m, TensorStorageMetadata) and n.startswith(("model.", "optimizer.state."))}
        dcp.load(out, checkpoint_id=path, no_dist=True)
        return out

    two, three, one = tensors(2), tensors(3), tensors(1)
    assert two.keys() == three.keys() and any(".exp_avg_sq" in n for n in two)
    for name in two:
        assert torch.equal(two[name], three[name]), name
    assert not torch.equal(one["model.output.weight"], two["model.output.weight"])  # step 2 did update


@pytest.mark.slow
def test_a_skip_between_logged_steps_is_reported_at_the_next_one(tmp_path):
    """Logging every 4 steps, the host reads the device at steps 1, 4 and 8 only (and at the save
    due at step 3): step 3's skip is still recorded as its own, the checkpoint due then still
    waits for step 4, and the run trains exactly as with every step logged."""
    every = write_run(tmp_path, "every", tiny_config(checkpoint={"interval": 3, "keep_last": 5}))
    fourth = write_run(tmp_path, "fourth", tiny_config(checkpoint={"interval": 3, "keep_last": 5},
                                                       logging={"interval": 4}))
    assert _train_poisoned(every, step=3) == 0 and _train_poisoned(fourth, step=3) == 0
    history = records(fourth.parent)
    trained = {r["step"]: r for r in history if r["kind"] == "train"}
    assert sorted(trained) == [1, 4, 8]
    assert [r["step"] for r in history if r["kind"] == "nonfinite"] == [3]
    assert [trained[s]["skipped_steps"] for s in (1, 4, 8)] == [0, 1, 1]
    reference = {r["step"]: r for r in records(every.parent) if r["kind"] == "train"}
    for step in (1, 4, 8):
        assert trained[step]["loss"] == reference[step]["loss"], step
    assert assert_checkpoints_finite(fourth.parent / "checkpoints") == [4, 6, 8]


@pytest.mark.slow
def test_a_streak_found_at_a_later_sync_names_the_step_it_reached_the_limit(tmp_path, capsys):
    """lr 1e30 with logging every 100 steps: steps 2-4 are skipped on the device, the updates
    after them held, and the host sees the streak at the next sync (the last step, 8): the error
    names step 4, as when every step was checked, and nothing non-finite was saved."""
    cfg = tiny_config(train={"lr": 1e30, "min_lr": 0.0, "max_nonfinite_steps": 3}, logging={"interval": 100},
                      checkpoint={"interval": 1000, "save_initial": True})
    config = write_run(tmp_path, "late", cfg)
    assert main(["--config", str(config)], data=synthetic_data) == NONFINITE_EXIT
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "3 steps in a row (to step 4)" in err[0] and "those of step 1" in err[0]
    history = records(config.parent)
    assert [(r["step"], r["in_a_row"]) for r in history if r["kind"] == "nonfinite"] == [(2, 1), (3, 2), (4, 3)]
    assert [r["step"] for r in history if r["kind"] == "train"] == [1]
    assert assert_checkpoints_finite(config.parent / "checkpoints") == [0]


@pytest.mark.multiproc
def test_ranks_agree_to_skip_a_step_only_one_of_them_saw(tmp_path):
    """The loss is NaN on rank 1 only (dp=2 with DDP: its gradient is all-reduced, FSDP: reduce-scattered,
    TP: the loss is the same on tp peers): every rank must skip, and the run then continues
    exactly as the single process with the same step poisoned."""
    base = dict(checkpoint={"interval": 1000})
    single = write_run(tmp_path, "single", tiny_config(**base))
    assert _train_poisoned(single, step=3) == 0
    layouts = {
        "fsdp": tiny_config(parallel={"dp": 2}, train={"grad_accum_steps": 2}, **base),
        "ddp": tiny_config(parallel={"dp": 2, "dp_mode": "ddp", "zero_stage": 0}, train={"grad_accum_steps": 2},
                           **base),
        "tp": tiny_config(parallel={"tp": 2}, **base),
    }
    configs = [write_run(tmp_path, name, cfg) for name, cfg in layouts.items()]
    # Rank 1 is dp rank 1 (fsdp, ddp: step 3's poisoned micro batches are its 2 of 4) or a tp peer.
    torchrun(2, configs, env=clean_env(**{POISON_ENV: "3:1"}))
    want = [r for r in records(single.parent) if r["kind"] == "train"]
    for config in configs:
        got = [r for r in records(config.parent) if r["kind"] == "train"]
        assert [r["step"] for r in got] == list(range(1, 9)), config.parent.name
        assert [r["skipped_steps"] for r in got] == [0, 0, 1, 1, 1, 1, 1, 1], config.parent.name
        for g, w in zip(got, want):
            if w["loss"] is None:
                continue
            assert g["loss"] == pytest.approx(w["loss"], rel=LOSS_RTOL), f"{config.parent.name} step {g['step']}"
        assert assert_checkpoints_finite(config.parent / "checkpoints") == [8]


def test_checkpointer_refuses_non_finite_state(tmp_path):
    """Model or optimizer state holding a NaN or inf: refused before anything is written."""
    from trainer.checkpoint import Checkpointer, NonFiniteError
    from trainer.states import ModelState, OptimizerState
    from trainer.config import CheckpointSection

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    states = {"model": ModelState(model), "optimizer": OptimizerState(model, opt)}
    ck = Checkpointer(tmp_path, CheckpointSection(keep_last=1))
    ck.save(1, states)
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"not saving checkpoint step 2: model\.1\.weight holds non-finite .* "
                                             r"the latest checkpoint stays .*step-000001"):
        ck.save(2, states)
    with torch.no_grad():
        model[1].weight[0, 0] = 0.0
    opt.state[model[0].weight]["exp_avg_sq"][1, 1] = float("inf")
    with pytest.raises(NonFiniteError, match=r"optimizer\.state\.0\.weight\.exp_avg_sq"):
        ck.save(3, states)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]  # keep_last 1: still the good one
