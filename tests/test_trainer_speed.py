"""The trainer's speed options (issue 10) that the layout-equivalence runs in
test_trainer_parallel.py do not show by their losses alone:

- loss parallel over a padded vocabulary: the padded columns are masked, so the loss and
  every gradient are those of the unpadded model (tp=2, gloo);
- the stop vote: one rank alone asks to stop and every rank stops after the same step;
- the device-side skip of a non-finite step (`SkippableStep`) on the fused optimizer;
- the first step of an attempt as a warm-up outside the throughput figures, and logging
  every N steps;
- garbage collection on a fixed step interval;
- torch.compile failing with one clear line; the config fields and their checks; float8
  refused where it cannot run; the per-preset layout advice (torch-free).

The file doubles as the worker script of its two-process test:
`torchrun --nproc-per-node 2 tests/test_trainer_speed.py OUT_DIR CONFIG`.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # when run as a worker script
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_helpers import TINY_MODEL, clean_env, read_metrics, synthetic_data, tiny_config, write_run  # noqa: E402

STOP_STEP = 3  # the worker's rank 1 alone sees a stop request from this step on
STOPPED_AT = 4  # the next sync step (logging.interval 4), where the ranks vote on it


# ---- the two-process worker -------------------------------------------------------------


def _loss_parallel_check(tied: bool) -> dict:
    """tp=2 with loss parallel over 250 tokens padded to 256, the padded rows set to 30 (a padded
    logit that entered the softmax would dominate it), against the unpadded model in one process."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from trainer.config import ModelSection
    from trainer.model import Transformer
    from trainer.parallel import apply_tp
    from trainer.runners import cross_entropy

    common = {**TINY_MODEL, "vocab_size": 250, "tie_embeddings": tied}
    plain = Transformer(ModelSection(**common, pad_vocab_multiple=1))
    padded = Transformer(ModelSection(**common, pad_vocab_multiple=64))
    with torch.no_grad():
        for p, q in zip(padded.parameters(), plain.parameters()):
            if p.shape[0] == 256:
                p[:250] = q
                p[250:] = 30.0
            else:
                p.copy_(q)
    tokens_BT = torch.randint(0, 250, (3, 17), generator=torch.Generator().manual_seed(0))
    inputs_BT, targets_BT = tokens_BT[:, :-1], tokens_BT[:, 1:]
    want = F.cross_entropy(plain(inputs_BT).flatten(0, 1), targets_BT.flatten(0, 1))
    want.backward()
    captured = {}  # the output projection's padded logits, before the model cuts or masks them
    hook = padded.output.register_forward_hook(lambda module, args, out: captured.update(logits=out.detach()))
    with torch.no_grad():
        padded(inputs_BT)
    hook.remove()
    unmasked = F.cross_entropy(captured["logits"].flatten(0, 1), targets_BT.flatten(0, 1))  # were they not masked

    apply_tp(padded, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), sequence_parallel=False,
             loss_parallel=True)
    logits = padded(inputs_BT)
    with loss_parallel():
        got = cross_entropy(logits, targets_BT)
        got.backward()
    grad = padded.output.weight.grad
    grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return {"logits_placement": str(logits.placements), "logits_local_columns": logits.to_local().shape[-1],
            "loss": got.item(), "want": want.item(), "unmasked": unmasked.item(),
            "padded_rows_grad_max": grad[250:].abs().max().item(),
            "real_rows_grad_err": (grad[:250] - plain.output.weight.grad).abs().max().item(),
            "real_rows_grad_max": plain.output.weight.grad.abs().max().item()}


def _stop_on_one_rank(rank: int, step: int):
    """StopSignal.requested (asked at the start of sync steps) turns true on `rank` alone once
    `step` has begun (BatchFeeder.next runs once a step, after the vote starts); returns the
    function that puts the originals back."""
    from trainer.loop import BatchFeeder, StopSignal

    original, next_batches = StopSignal.requested, BatchFeeder.next
    begun = [0]

    def counted(self, *args, **kwargs):
        begun[0] += 1
        return next_batches(self, *args, **kwargs)

    def requested(self) -> bool:
        if int(os.environ.get("RANK", "0")) == rank and begun[0] >= step:
            self.received = "a test's stop request"
        return original(self)

    StopSignal.requested, BatchFeeder.next = requested, counted

    def restore() -> None:
        StopSignal.requested, BatchFeeder.next = original, next_batches

    return restore


def worker(out_dir: str, config: str) -> int:
    import torch.distributed as dist

    from trainer.train import main

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    checks = {f"tied={tied}": _loss_parallel_check(tied) for tied in (False, True)}
    Path(out_dir, f"loss_parallel_rank{rank}.json").write_text(json.dumps(checks))
    restore = _stop_on_one_rank(rank=1, step=STOP_STEP)
    try:
        code = main(["--config", config], data=synthetic_data)
    finally:
        restore()
    Path(out_dir, f"exit_rank{rank}.json").write_text(json.dumps(code))
    dist.destroy_process_group()
    return code


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("speed")
    config = write_run(out, "stop_vote", tiny_config(parallel={"dp": 2}, train={"grad_accum_steps": 2},
                                                    logging={"interval": 4}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           str(out), str(config)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean_env(), cwd=ROOT)
    return out, config.parent, proc


@pytest.mark.multiproc
@pytest.mark.parametrize("tied", [False, True])
def test_loss_parallel_masks_the_padded_vocabulary(two_ranks, tied):
    """Each rank holds half of the 256 columns; the loss and the real rows' gradients are the
    unpadded model's (to the shards' summation order), the padded rows get no gradient, and
    without the mask the loss would be far off (so the comparison can fail)."""
    out, _, proc = two_ranks
    for rank in (0, 1):
        path = out / f"loss_parallel_rank{rank}.json"
        assert path.exists(), proc.stderr[-4000:]
        check = json.loads(path.read_text())[f"tied={tied}"]
        assert check["logits_placement"] == "(Shard(dim=2),)" and check["logits_local_columns"] == 128
        assert check["loss"] == pytest.approx(check["want"], rel=1e-6, abs=0)
        assert abs(check["unmasked"] - check["want"]) > 1.0
        assert check["padded_rows_grad_max"] == 0.0
        assert check["real_rows_grad_err"] <= 1e-5 * check["real_rows_grad_max"]


@pytest.mark.multiproc
def test_a_stop_seen_by_one_rank_stops_all_after_the_same_step(two_ranks):
    """Rank 1 alone sees a request from step 3 on: the vote of the next sync step (4) carries it
    to rank 0 by the end of that step, and both save step 4 and exit 75."""
    out, run_dir, proc = two_ranks
    assert [json.loads((out / f"exit_rank{r}.json").read_text()) for r in (0, 1)] == [75, 75], proc.stderr[-4000:]
    assert [r["step"] for r in read_metrics(run_dir)] == [1, STOPPED_AT]
    assert (run_dir / "checkpoints" / f"step-{STOPPED_AT:06d}" / "COMPLETE").exists()
    assert not (run_dir / "checkpoints" / f"step-{STOPPED_AT + 1:06d}").exists()
    assert f"stopping after step {STOPPED_AT} on a test's stop request" in proc.stderr
    assert f"stopping after step {STOPPED_AT} on a request seen by another rank" in proc.stderr


# ---- the device-side skip ----------------------------------------------------------------


def test_skippable_step_skips_bad_steps_and_holds_after_the_limit():
    """limit 2: a good update, two bad ones skipped (weights and AdamW state untouched), then a
    good step that is skipped too: the streak reached the limit, and the run stops at the next
    sync with the weights of the last good step. The trainer's optimizer is fused (the skip's
    `found_inf` input) for every parameter group."""
    from trainer.config import TrainSection
    from trainer.optim import SkippableStep, build_optimizer

    model = torch.nn.Linear(4, 3)
    opt = build_optimizer(model, TrainSection(lr=0.1, warmup_steps=0))
    assert all(group["fused"] for group in opt.param_groups)
    guard = SkippableStep(opt, limit=2, streak=0, device=torch.device("cpu"))

    def step(bad: bool) -> float:
        for p in model.parameters():
            p.grad = torch.full_like(p, float("nan") if bad else 1.0)
        return guard.step(torch.tensor(float(bad))).item()

    assert step(False) == 0.0
    weights = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in opt.state[model.weight].items()}
    assert [step(True), step(True), step(False)] == [1.0, 1.0, 1.0]
    assert guard.streak.item() == 3
    for p, w in zip(model.parameters(), weights):
        assert torch.equal(p, w)
    for k, v in state.items():
        assert torch.equal(opt.state[model.weight][k], v), k


def test_a_resumed_streak_counts_on():
    from trainer.optim import SkippableStep

    model = torch.nn.Linear(2, 2)
    guard = SkippableStep(torch.optim.AdamW(model.parameters(), fused=True), limit=3, streak=2,
                          device=torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = model.weight.detach().clone()
    assert guard.step(torch.tensor(1.0)).item() == 1.0 and guard.streak.item() == 3
    assert guard.step(torch.tensor(0.0)).item() == 1.0  # held: the limit was reached
    assert torch.equal(model.weight, before)


# ---- what a run logs, and when --------------------------------------------------------------


def _train(tmp_path: Path, name: str, **sections) -> Path:
    from trainer.train import main

    config = write_run(tmp_path, name, tiny_config(**sections))
    assert main(["--config", str(config)], data=synthetic_data) == 0
    return config.parent


@pytest.mark.slow
def test_the_first_step_is_a_warm_up_outside_the_figures_and_logging_is_every_n_steps(tmp_path):
    every = _train(tmp_path, "every")
    fourth = _train(tmp_path, "fourth", logging={"interval": 4})
    records = read_metrics(fourth)
    assert [r["step"] for r in records] == [1, 4, 8]  # an attempt's first step, then every 4th, and the last
    first = records[0]
    assert first["warmup_s"] > 0 and first["tokens_per_s"] is None and first["mfu"] is None
    assert first["step_time_s"] is None
    assert all("warmup_s" not in r and r["tokens_per_s"] > 0 for r in records[1:])
    by_step = {r["step"]: r for r in read_metrics(every)}
    for r in records:  # the losses stay on the device until a logged step, and are the same
        assert r["loss"] == by_step[r["step"]]["loss"] and r["grad_norm"] == by_step[r["step"]]["grad_norm"]


@pytest.mark.slow
def test_garbage_is_collected_every_gc_interval_steps_with_the_collector_off(tmp_path, monkeypatch):
    calls: list[tuple[int, bool]] = []
    collect = gc.collect

    def counting(generation: int = 2) -> int:
        calls.append((generation, gc.isenabled()))
        return collect(generation)

    monkeypatch.setattr(gc, "collect", counting)
    assert gc.isenabled()
    _train(tmp_path, "gc", train={"gc_interval": 3})
    assert gc.isenabled()  # given back as it was
    ours = [c for c in calls if c[0] == 1]
    assert ours == [(1, False)] * 3  # once at the start, then after steps 3 and 6 of 8, the collector off


@pytest.mark.slow
def test_a_compile_failure_is_one_line_naming_train_compile(tmp_path):
    """inductor without a working C++ compiler (CXX=/bin/false, its caches off so it must
    compile): exit 2 with the reason and the way out, not a page of traceback."""
    config = write_run(tmp_path, "compiled", tiny_config(train={"compile": True, "steps": 2}))
    env = clean_env(CXX="/bin/false", TORCHINDUCTOR_FORCE_DISABLE_CACHES="1",
                    TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "trainer_helpers.py"), str(config)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert len(errors) == 1 and errors[0].startswith("error: train.compile: torch.compile failed (")
    assert "set train.compile: false" in errors[0] and "Traceback" not in proc.stderr


# ---- config ---------------------------------------------------------------------------------


def test_compile_is_off_by_default_and_true_or_false():
    """torchtitan's rule: off unless asked, and strict when on (no fall-back to eager)."""
    from common.errors import ConfigError
    from common.schema import from_dict
    from common.yaml import read_yaml
    from trainer.config import TrainSection

    assert TrainSection().compile is False
    for text, want in (("true", True), ("false", False), ("TRUE", True)):
        assert from_dict(TrainSection, read_yaml(f"compile: {text}", "t"), "train").compile == want
    for wrong in ("auto", "yes"):
        with pytest.raises(ConfigError, match=r"^train\.compile: expected true or false"):
            from_dict(TrainSection, {"compile": wrong}, "train")


def test_activation_checkpointing_and_gc_fields_are_checked():
    from common.errors import ConfigError
    from common.schema import from_dict
    from trainer.config import TrainSection

    assert from_dict(TrainSection, {"activation_checkpointing": "selective", "selective_ac": "2"}).selective_ac == "2"
    with pytest.raises(ConfigError, match=r"^train\.selective_ac: must be op .* or a whole number N >= 1"):
        from_dict(TrainSection, {"selective_ac": "0"}, "train")
    with pytest.raises(ConfigError, match=r"^train\.activation_checkpointing: must be one of 'none', 'selective', "
                                          r"'full', got 'some'"):
        from_dict(TrainSection, {"activation_checkpointing": "some"}, "train")
    with pytest.raises(ConfigError, match=r"^train\.gc_interval: must be >= 0"):
        from_dict(TrainSection, {"gc_interval": -1}, "train")


def test_activation_checkpointing_marks_the_right_blocks():
    from trainer.compute import apply_ac
    from trainer.config import ModelSection
    from trainer.model import Transformer

    model = Transformer(ModelSection(**{**TINY_MODEL, "num_layers": 6}))
    apply_ac(model, "selective", "2")
    assert [name for name, layer in model.layers.items() if layer.recompute is not None] == ["1", "3", "5"]
    apply_ac(model, "full", "op")
    assert all(layer.recompute is not None for layer in model.layers.values())
    assert not [n for n, _ in model.named_parameters() if "checkpoint" in n]  # names are the checkpoint contract


def test_float8_is_refused_where_it_cannot_run(monkeypatch):
    from trainer.compute import check_float8
    from common.errors import ConfigError
    from trainer.config import TrainSection

    on = TrainSection(float8=True)
    check_float8(TrainSection(), torch.device("cpu"))  # off: nothing to check
    with pytest.raises(ConfigError, match=r"^train\.float8: float8 matmuls need a CUDA GPU .* this run is on cpu"):
        check_float8(on, torch.device("cpu"))
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match=r"A100-SXM4-80GB has compute capability 8\.0, float8 needs >= 8\.9"):
        check_float8(on, cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "torchao", None)  # not installed
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigError, match=r"float8 training needs torchao, which does not import .*installs the "
                                          r"float8 extra where train\.float8 is on\), or pip install 'slipway\[float8\]'"):
        check_float8(on, cuda)


def test_float8_on_cpu_is_a_config_error_before_any_data(tmp_path):
    from trainer.train import main

    def no_data(*args):
        raise AssertionError("data built before the float8 check")

    config = write_run(tmp_path, "f8", tiny_config(train={"float8": True}))
    assert main(["--config", str(config)], data=no_data) == 2


def test_layout_advice_for_the_flagship_and_none_for_custom_models():
    from trainer.config import load_trainer_config
    from common.layouts import LAYOUT_DEFAULTS, layout_advice

    assert set(LAYOUT_DEFAULTS) == {"tiny", "small", "base", "large"}
    advice = layout_advice(load_trainer_config(ROOT / "configs" / "tiny_wikitext.yaml"))
    assert advice.startswith("parallel: tp(4) splits the tiny preset (109M parameters)")
    assert ("parallel.dp=8 parallel.tp=1 parallel.pp=1 (FSDP) with train.micro_batch_size=16, the same global "
            "batch of 128 sequences") in advice
    assert layout_advice(load_trainer_config(ROOT / "configs" / "tiny_cpu.yaml")) is None  # custom: no table row
    from common.schema import from_dict
    from trainer.config import TrainerConfig

    pp = from_dict(TrainerConfig, {"model": {"size": "base"}, "parallel": {"dp": 2, "pp": 2},
                                   "train": {"micro_batch_size": 3, "grad_accum_steps": 2}, "data": {"seq_len": 512}})
    text = layout_advice(pp)
    assert "pp(2)" in text and "bubbles" in text and "tp(" not in text
    assert "train.micro_batch_size=3, the same global batch of 12 sequences" in text
    fine = from_dict(TrainerConfig, {"model": {"size": "base"}, "parallel": {"dp": 4}, "data": {"seq_len": 512}})
    assert layout_advice(fine) is None


def test_layout_advice_imports_no_torch():
    code = ("import sys; from common.layouts import layout_advice; from trainer.config import load_trainer_config; "
            "print(layout_advice(load_trainer_config('configs/tiny_wikitext.yaml')) is not None, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=clean_env())
    assert proc.stdout.split() == ["True", "False"], proc.stderr


# ---- trainer/speed.py: what gpu-check and bench/trainer.py's GPU comparison compute ------------


def test_throughput_is_timed_over_whole_logged_windows_after_the_warmup():
    """Records every 10 steps after a warm-up step 1: windows (10, 20] and (20, 30] count,
    weighted by their steps; the warm-up and the window that starts before step 10 do not."""
    from trainer.speed import steady

    records = [{"step": 1, "tokens_per_s": None, "step_time_s": None, "peak_memory_gib": 1.0},
               {"step": 10, "tokens_per_s": 50.0, "step_time_s": 9.0, "peak_memory_gib": 1.0},
               {"step": 20, "tokens_per_s": 100.0, "step_time_s": 1.0, "peak_memory_gib": 2.0},
               {"step": 30, "tokens_per_s": 300.0, "step_time_s": 0.5, "peak_memory_gib": 1.5}]
    out = steady(records, warmup=10)
    assert out["steps_timed"] == 20 and out["peak_memory_gib"] == 2.0
    assert out["tokens_per_s"] == pytest.approx((10 * 100.0 + 5 * 300.0) / 15.0)
    with pytest.raises(ValueError, match="no logged window starts at or after step 30"):
        steady(records, warmup=30)


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_the_torchtitan_config_module_renders(ac):
    """The config module handed to torchtitan is valid Python with our settings in it (torchtitan
    itself needs CUDA: its run is the GPU half of the comparison)."""
    import ast
    import importlib.util

    spec = importlib.util.spec_from_file_location("titan", Path(__file__).resolve().parents[1] / "bench" / "titan.py")
    titan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(titan)
    TITAN_MODULE = titan.TITAN_MODULE

    params = dict(dim=64, heads=4, kv_heads=2, layers=2, vocab=256, ffn=128, seq_len=32, batch=2, steps=4,
                  dtype="bfloat16", compile=True, ac=ac, log_freq=10, corpus="c", assets="a", dump="d")
    tree = ast.parse(TITAN_MODULE.format(params=params))
    assert any(isinstance(node, ast.FunctionDef) and node.name == "slipway_llama" for node in tree.body)
    assert '"ac": ' + repr(ac) in TITAN_MODULE.format(params=params).replace("'ac'", '"ac"')


# ---- on a GPU: no host sync inside a step ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False here")
def test_no_host_sync_between_sync_steps(tmp_path, monkeypatch):
    """CUDA's sync debug mode warns on every operation that makes the host wait for the device.
    With logging every 8 steps, steps 2 to 7 must warn none: only step 1 (the warm-up) and
    step 8 (logged, saved) are sync steps."""
    import trainer.train as train_mod

    events: list[str] = []
    replay, next_batches = train_mod._replay, train_mod.BatchFeeder.next

    def marked_replay(pending, *args, **kwargs):
        events.append(f"sync {pending[-1][0]}")
        return replay(pending, *args, **kwargs)

    def marked_next(self, *args, **kwargs):  # once a step
        events.append("step")
        return next_batches(self, *args, **kwargs)

    monkeypatch.setattr(train_mod, "_replay", marked_replay)
    monkeypatch.setattr(train_mod.BatchFeeder, "next", marked_next)
    config = write_run(tmp_path, "gpu", tiny_config(train={"dtype": "bfloat16"}, logging={"interval": 8}))
    previous = warnings.showwarning

    def show(message, *args, **kwargs):
        if "synchroniz" in str(message):
            events.append("host sync")

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            assert train_mod.main(["--config", str(config)], data=synthetic_data) == 0
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = previous
    between = events[events.index("sync 1") + 1:events.index("sync 8")]
    assert between.count("step") == 7 and "host sync" not in between, between


if __name__ == "__main__":
    sys.exit(worker(*sys.argv[1:]))
