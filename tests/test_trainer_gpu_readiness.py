"""What the first run on real GPUs depends on, proved on the CPU (issue 20): collective
timeouts longer than the hang watchdog's limits, graph breaks reported, float8's conversion
and tensor-parallel plan, memory defaults per preset, bf16 numerics under FSDP and tensor
parallel, a stop vote that costs nothing on most steps, and the supported torch range."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
import tomllib
from datetime import timedelta

import pytest
import torch

from common.errors import ConfigError
from common.rundir import RunDir
from common.schema import from_dict
from trainer.config import ModelSection, TrainSection, TrainerConfig
from common.layouts import GPU_BUDGET_FRACTION, LAYOUT_DEFAULTS, gpu_memory_estimate, resolve_reshard
from trainer.watchdog import COLLECTIVE_MARGIN_SECONDS, HARD_EXIT_SECONDS, collective_timeout
from trainer_helpers import ROOT, TINY_MODEL, clean_env, read_metrics, synthetic_data, tiny_config, write_run

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
NO_TORCHAO = "torchao is not installed (the float8 extra: pip install 'slipway[float8]')"


# ---- A. collective timeouts ---------------------------------------------------------


@pytest.mark.parametrize("hang, first, checkpoint", [(600, 1800, 1800), (3, 60, 1), (900, 900, 7200), (5, 10, 0)])
def test_collectives_outlast_the_watchdog_first_step_and_checkpoints_included(hang, first, checkpoint):
    timeout = collective_timeout(TrainSection(hang_timeout=hang, hang_timeout_first_step=first,
                                              checkpoint_timeout=checkpoint))
    # The watchdog fires at its limit and exits within HARD_EXIT_SECONDS: the collective must wait longer
    # (a rank that left a slow save early waits for the others in the next step's collectives).
    assert timeout.total_seconds() > max(hang, first, checkpoint) + HARD_EXIT_SECONDS
    assert timeout == timedelta(seconds=max(hang, first, checkpoint) + COLLECTIVE_MARGIN_SECONDS)


def test_with_the_watchdog_off_collectives_keep_a_long_timeout():
    timeout = collective_timeout(TrainSection(hang_timeout=0))
    assert timeout >= timedelta(minutes=30)  # NCCL's own 10 min would abort a compiling first step


# ---- G. the supported torch range ----------------------------------------------------


@pytest.mark.parametrize("version, warns", [("2.10.0a0+b465a5843b.nv25.12", False), ("2.13.0+cpu", False),
                                            ("2.11.1", False), ("2.9.1+cu128", True), ("2.15.0", True),
                                            ("3.0.0", True), ("weird", False)])
def test_a_torch_outside_the_tested_range_gets_one_warning_line(version, warns):
    from trainer.train import unsupported_torch

    warning = unsupported_torch(version)
    assert (warning is not None) == warns, warning
    if warning:
        assert "\n" not in warning and "2.10 to 2.13" in warning and "torch>=2.10,<2.14" in warning


def test_pyproject_makefile_and_trainer_name_one_torch_range():
    from trainer.train import SUPPORTED_TORCH

    (lo, hi) = SUPPORTED_TORCH
    spec = f"torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert spec in extras["trainer"]
    assert re.search(rf"^TORCH_SPEC \?= {re.escape(spec)}$", (ROOT / "Makefile").read_text(), re.M)
    assert unsupported_torch_ok(torch.__version__), f"this venv's torch {torch.__version__} is outside {spec}"
    assert any(dep.startswith("torchao>=") for dep in extras["float8"])


def unsupported_torch_ok(version: str) -> bool:
    from trainer.train import unsupported_torch

    return unsupported_torch(version) is None


# ---- B. graph breaks ------------------------------------------------------------------


def _tiny_model(num_layers: int = 2):
    from trainer.model import Transformer

    cfg = from_dict(ModelSection, {**TINY_MODEL, "num_layers": num_layers}, "model")
    model = Transformer(cfg, "sdpa")
    model.init_weights(0)
    return model


def _train_once(model) -> None:
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model(tokens).float().logsumexp(-1).mean().backward()


@pytest.mark.slow
def test_compiled_blocks_have_no_graph_breaks():
    """Dynamo's tracing decides graph breaks, whatever backend runs the graphs: the eager
    backend finds the same breaks as inductor without the CPU's C++ build."""
    import torch._dynamo

    from trainer.compute import apply_ac, compile_blocks, graph_break_report, graph_breaks, reset_graph_breaks

    for ac, selective in (("none", "op"), ("full", "op"), ("selective", "op"), ("selective", "2")):
        torch._dynamo.reset()
        reset_graph_breaks()
        model = _tiny_model()
        apply_ac(model, ac, selective)
        compile_blocks(model, backend="eager")
        _train_once(model)
        assert graph_breaks() == {}, (ac, selective, graph_break_report())
        assert graph_break_report() == "compile: 0 graph breaks (every block one graph)"


@pytest.mark.slow
def test_a_graph_break_is_counted_and_named():
    import torch._dynamo

    from trainer.compute import compile_blocks, graph_break_report, graph_breaks, reset_graph_breaks

    torch._dynamo.reset()
    reset_graph_breaks()
    model = _tiny_model()
    block = model.layers["0"]
    forward = block.forward

    def breaking(*args, **kwargs):
        print("", end="")  # a side effect dynamo cannot trace: a graph break
        return forward(*args, **kwargs)

    block.forward = breaking
    compile_blocks(model, backend="eager")
    _train_once(model)
    assert sum(graph_breaks().values()) >= 1
    report = graph_break_report()
    assert report.startswith("compile: ") and "graph breaks" in report and "\n" not in report
    assert "print" in report or "builtin" in report.lower(), report


# ---- C. float8 ---------------------------------------------------------------------------


def test_float8_off_a_hopper_gpu_is_refused_in_one_line():
    from trainer.compute import check_float8

    with pytest.raises(ConfigError) as exc:
        check_float8(TrainSection(float8=True), torch.device("cpu"))
    assert exc.value.field == "train.float8" and "\n" not in str(exc.value)
    assert "H100" in str(exc.value) and "train.float8: false" in str(exc.value)


def test_float8_without_torchao_names_the_extra(monkeypatch):
    from trainer.compute import require_torchao

    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed: the import fails
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigError) as exc:
        require_torchao()
    assert exc.value.field == "train.float8" and "\n" not in str(exc.value)
    assert "pip install 'slipway[float8]'" in str(exc.value)
    assert "`slipway image build CONFIG` installs the float8 extra where train.float8 is on" in str(exc.value)


FLOAT8_LINEARS = {f"layers.{i}.{name}" for i in range(2) for name in
                  ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                   "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}


def _meta_float8_model(recipe: str = "rowwise"):
    from trainer.compute import apply_float8
    from trainer.model import Transformer

    cfg = from_dict(ModelSection, {**TINY_MODEL, "num_layers": 2}, "model")
    with torch.device("meta"):
        model = Transformer(cfg, "sdpa")
    apply_float8(model, recipe)
    return model


@pytest.mark.skipif(not HAS_TORCHAO, reason=NO_TORCHAO)
def test_the_float8_recipe_is_rowwise_unless_chosen():
    """torchtitan's default: a scale per row; tensorwise and rowwise_with_gw_hp on request."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    assert TrainSection().float8_recipe == "rowwise"
    with pytest.raises(ConfigError, match=r"^train\.float8_recipe: "):
        from_dict(TrainSection, {"float8_recipe": "columnwise"}, "train")
    granularity = {}
    for recipe in ("rowwise", "rowwise_with_gw_hp", "tensorwise"):
        from_dict(TrainSection, {"float8_recipe": recipe}, "train")
        linear = next(m for m in _meta_float8_model(recipe).modules() if isinstance(m, Float8Linear))
        config = linear.config
        granularity[recipe] = (config.cast_config_input.scaling_granularity,
                               config.cast_config_grad_output.scaling_granularity)
    assert granularity["rowwise"] == (ScalingGranularity.AXISWISE, ScalingGranularity.AXISWISE)
    assert granularity["tensorwise"] == (ScalingGranularity.TENSORWISE, ScalingGranularity.TENSORWISE)
    assert granularity["rowwise_with_gw_hp"][0] == ScalingGranularity.AXISWISE


@pytest.mark.skipif(not HAS_TORCHAO, reason=NO_TORCHAO)
def test_float8_converts_the_block_linears_and_only_those():
    from torchao.float8.float8_linear import Float8Linear

    model = _meta_float8_model()
    converted = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == FLOAT8_LINEARS
    assert type(model.output) is torch.nn.Linear  # the logits stay bf16
    # Parameter names do not change: checkpoints stay float8-independent.
    assert {n for n, _ in model.named_parameters()} == {n for n, _ in _tiny_model().named_parameters()}


@pytest.mark.skipif(not HAS_TORCHAO, reason=NO_TORCHAO)
def test_the_tensor_parallel_plan_maps_the_float8_linears(tmp_path):
    """The plan shards the converted modules as it does nn.Linear: q/k/v, w1/w3 by columns,
    wo/w2 by rows (a one-process gloo mesh: the placements are what the plan decides)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torchao.float8.float8_linear import Float8Linear

    from trainer.parallel import apply_tp

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        model = _meta_float8_model()
        apply_tp(model, mesh, sequence_parallel=True, loss_parallel=True)
        for name, module in model.named_modules():
            if name not in FLOAT8_LINEARS:
                continue
            assert isinstance(module, Float8Linear), name
            assert isinstance(module.weight, DTensor), name
            rowwise = name.endswith(("wo", "w2"))
            assert module.weight.placements == ((Shard(1),) if rowwise else (Shard(0),)), name
        assert model.output.weight.placements == (Shard(0),)
        assert model.layers["0"].attention_norm.weight.placements == (Replicate(),)
    finally:
        dist.destroy_process_group()


# ---- D. memory defaults -------------------------------------------------------------------


GPU_MEMORY_GB = {"H100": 80, "GH200": 96}


@pytest.mark.parametrize("preset", list(LAYOUT_DEFAULTS))
@pytest.mark.parametrize("gpu", list(GPU_MEMORY_GB))
def test_each_preset_default_fits_one_node_of_h100_and_gh200(preset, gpu):
    default = LAYOUT_DEFAULTS[preset]
    parts = gpu_memory_estimate(ModelSection(size=preset), default.micro_batch_size, default.seq_len, 4,
                                default.reshard_after_forward, default.activation_checkpointing)
    assert sum(parts.values()) < GPU_BUDGET_FRACTION * GPU_MEMORY_GB[gpu] * 1e9, (preset, parts)


def test_large_reshards_by_default_and_explicit_settings_win():
    def cfg(size: str, **parallel) -> TrainerConfig:
        return from_dict(TrainerConfig, {"model": {"size": size}, "parallel": {"dp": 4, **parallel},
                                         "data": {"seq_len": 512}})

    assert resolve_reshard(cfg("large")) == (True, "the large preset's default, common/layouts.py")
    assert resolve_reshard(cfg("tiny")) == (False, "zero_stage 1")
    assert resolve_reshard(cfg("tiny", zero_stage=3)) == (True, "zero_stage 3")
    assert resolve_reshard(cfg("large", reshard_after_forward="false"))[0] is False
    assert resolve_reshard(cfg("small", reshard_after_forward="true"))[0] is True
    # Keeping large's gathered weights costs 2 bytes a parameter on every GPU.
    large = ModelSection(size="large")
    kept = gpu_memory_estimate(large, 2, 4096, 4, False, "selective")["gathered"]
    assert kept == pytest.approx(2 * large.num_params())


# ---- F. the stop vote only on sync steps -----------------------------------------------------


def test_the_stop_vote_runs_on_sync_steps_only(tmp_path, monkeypatch):
    """A process group of one runs the same collectives as a large job: count the votes and the
    stop-file checks over 9 steps logged every 4 (sync steps: 1, 4, 8, 9)."""
    import torch.distributed as dist

    import trainer.train as train_mod

    votes, checks = [], [0]

    class CountedVote(train_mod.StopVote):  # counts its all-reduces
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.rounds = 0
            votes.append(self)

        def start(self, requested: bool) -> None:
            super().start(requested)
            self.rounds += self.group is not None

    original = train_mod.StopSignal.requested

    def counted(self) -> bool:
        checks[0] += 1
        return original(self)

    monkeypatch.setattr(train_mod, "StopVote", CountedVote)
    monkeypatch.setattr(train_mod.StopSignal, "requested", counted)
    config = write_run(tmp_path, "votes", tiny_config(train={"steps": 9, "grad_accum_steps": 1},
                                                      logging={"interval": 4}))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert train_mod.main(["--config", str(config)], data=synthetic_data) == 0
    finally:
        dist.destroy_process_group()
    assert [v.rounds for v in votes] == [4] and checks[0] == 4
    assert [r["step"] for r in read_metrics(config.parent)] == [1, 4, 8, 9]


STOP_WORLD = """
import os, sys, time
sys.path.insert(0, {tests!r})
import trainer_helpers
from trainer.train import main

class Slow(trainer_helpers.SyntheticSampler):
    def next_batch(self):
        time.sleep(0.05)
        return super().next_batch()

def data(cfg, run_dir, dp_rank, dp_size):
    make = lambda seed: Slow(seed, cfg.model.vocab_size, cfg.train.micro_batch_size, cfg.data.seq_len,
                             dp_rank, dp_size)
    return make(1), None, cfg.model.vocab_size

sys.exit(main(["--config", sys.argv[1]], data=data))
"""


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_stop_file_stops_every_rank_after_the_same_sync_step(tmp_path):
    """Only rank 0 looks for the stop file; the vote on the next sync step stops rank 1 with it:
    both save the same step's checkpoint (a collective) and exit 75."""
    cfg = tiny_config(parallel={"dp": 2}, train={"steps": 40, "grad_accum_steps": 2}, logging={"interval": 3})
    config = write_run(tmp_path, "stopped", cfg)
    script = tmp_path / "stop_world.py"
    script.write_text(STOP_WORLD.format(tests=str(ROOT / "tests")))
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(script), str(config)], env=clean_env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = config.parent / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and '"step": 1,' in metrics.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    RunDir(config.parent).stop_file.touch()
    out, err = proc.communicate(timeout=120)
    # torchrun ends the other worker (SIGTERM, -15) once the first exits 75.
    exits = re.findall(r"exitcode\s*:\s*(-?\d+)", err)
    assert "75" in exits and set(exits) <= {"75", "-15"}, err[-4000:]
    steps = [r["step"] for r in read_metrics(config.parent)]
    stopped_at = steps[-1]
    assert stopped_at < 40 and stopped_at % 3 == 0, steps  # a sync step
    assert "the stop file stop-requested" in err
    # Saving is collective: rank 1, which never looks for the file, was at the same step.
    assert (config.parent / "checkpoints" / f"step-{stopped_at:06d}" / "COMPLETE").exists()


# ---- E. bf16 numerics under FSDP and tensor parallel ---------------------------------------------

# bf16 keeps 8 bits of mantissa: over 6 AdamW steps of the tiny model the bf16 losses stayed
# within 2.6e-4 (relative) of the fp32 run under both FSDP and tp (torch 2.13, CPU); the
# tolerance leaves 8x of that.
BF16_LOSS_RTOL = 2e-3
# float8 (e4m3 forward, e5m2 gradients) keeps 3 bits of mantissa: the tiny model's logits at
# initialisation were within 5.1% (largest difference over the largest logit) of fp32's under
# tp=2, and its loss within 1e-5; a mis-sharded model is off by the logits' whole size.
FLOAT8_LOGITS_ERR = 0.15
FLOAT8_LOSS_RTOL = 1e-3

BF16_WORLD = """
import json, os, sys
sys.path.insert(0, {tests!r})
import torch
import torch.distributed as dist
import trainer_helpers
from trainer.config import load_trainer_config
from trainer.parallel import ParallelDims, build_model

dist.init_process_group("gloo")
from trainer.train import main
worst = 0
for path in sys.argv[2:]:
    worst = max(worst, main(["--config", path], data=trainer_helpers.synthetic_data))
# What the blocks' attention receives under FSDP's bf16 mixed precision.
cfg = load_trainer_config(sys.argv[2])
dims = ParallelDims.from_config(cfg.parallel, dist.get_world_size())
dims.build_mesh("cpu")
model = build_model(cfg, dims, torch.device("cpu"), torch.bfloat16)
seen = {{}}
model.layers["0"].attention.register_forward_pre_hook(
    lambda module, args: seen.update(x=str(args[0].dtype), cos=str(args[1].dtype), sin=str(args[2].dtype)))
model(torch.zeros(1, 8, dtype=torch.long))
# float8 linears (torchao) split by the tensor-parallel plan, against the same model unsplit in
# fp32: torch's CPU build has the scaled matmul float8 needs, so this runs where torchao is.
try:
    import torchao.float8  # noqa: F401
except ImportError:
    pass
else:
    from torch.distributed.device_mesh import init_device_mesh
    from trainer.compute import apply_float8
    from trainer.model import Transformer
    from trainer.parallel import apply_tp
    from trainer.runners import cross_entropy
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    plain = Transformer(cfg.model, "sdpa")
    plain.init_weights(5)
    with torch.device("meta"):
        f8 = Transformer(cfg.model, "sdpa")
    apply_float8(f8)
    apply_tp(f8, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), sequence_parallel=False)
    f8.to_empty(device="cpu")
    f8.init_weights(5)
    logits, want = f8(tokens[:, :-1]), plain(tokens[:, :-1]).detach()
    loss = cross_entropy(logits, tokens[:, 1:])
    loss.backward()
    seen.update(f8_logits_err=((logits.detach() - want).abs().max() / want.abs().max()).item(),
                f8_loss=loss.item(), plain_loss=cross_entropy(want, tokens[:, 1:]).item(),
                f8_grads_finite=all(bool(torch.isfinite(getattr(p.grad, "full_tensor", lambda: p.grad)()).all())
                                    for p in f8.parameters()),
                f8_types=sorted(set(type(m).__name__ for m in f8.modules() if "Linear" in type(m).__name__)))
if dist.get_rank() == 0:
    open(sys.argv[1], "w").write(json.dumps(seen))
dist.destroy_process_group()
sys.exit(worst)
"""


@pytest.mark.multiproc
@pytest.mark.slow
def test_bf16_under_fsdp_and_tensor_parallel_tracks_fp32(tmp_path):
    steps = {"steps": 6, "grad_accum_steps": 2, "warmup_steps": 1}
    reference = write_run(tmp_path, "fp32", tiny_config(parallel={"dp": 2}, train=steps))
    fsdp = write_run(tmp_path, "bf16_fsdp", tiny_config(parallel={"dp": 2}, train={**steps, "dtype": "bfloat16"}))
    tp = write_run(tmp_path, "bf16_tp", tiny_config(parallel={"tp": 2}, train={**steps, "grad_accum_steps": 4,
                                                                                "dtype": "bfloat16"}))
    script = tmp_path / "bf16_world.py"
    script.write_text(BF16_WORLD.format(tests=str(ROOT / "tests")))
    seen = tmp_path / "seen.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), str(seen), str(fsdp), str(tp), str(reference)], env=clean_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-5000:]
    want = [r["loss"] for r in read_metrics(reference.parent)]
    assert len(want) == 6
    for run in (fsdp, tp):
        got = [r["loss"] for r in read_metrics(run.parent)]
        assert got == pytest.approx(want, rel=BF16_LOSS_RTOL), (run.parent.name, got, want)
        assert got != want  # it did compute in bf16
    # The residual stream is bf16, the RoPE tables stay fp32 (not cast by FSDP's policy).
    checks = json.loads(seen.read_text())
    assert {k: checks[k] for k in ("x", "cos", "sin")} == {"x": "torch.bfloat16", "cos": "torch.float32",
                                                           "sin": "torch.float32"}
    if HAS_TORCHAO:  # float8 under tp=2: the plan's shards compute what the unsplit fp32 model does
        assert checks["f8_types"] == ["Float8Linear", "Linear"] and checks["f8_grads_finite"]
        assert checks["f8_logits_err"] < FLOAT8_LOGITS_ERR, checks
        assert checks["f8_loss"] == pytest.approx(checks["plain_loss"], rel=FLOAT8_LOSS_RTOL)


def test_the_memory_report_warns_before_an_out_of_memory():
    from common.layouts import memory_report

    def cfg(**train) -> TrainerConfig:
        return from_dict(TrainerConfig, {"model": {"size": "large"}, "parallel": {"dp": 4},
                                         "data": {"seq_len": 4096},
                                         "train": {"micro_batch_size": 2, **train}})

    h100 = 80 * 10**9
    line, warning = memory_report(cfg(activation_checkpointing="selective"), 4, True, h100)
    assert line.startswith("memory by common/layouts.py's arithmetic: ~54.8 GB a GPU") and warning is None
    line, warning = memory_report(cfg(), 4, False, h100)  # zero_stage 1 and no checkpointing: ~116 GB
    assert "\n" not in warning and "expect out-of-memory" in warning
    assert "train.activation_checkpointing: selective" in warning and "parallel.reshard_after_forward: true" in warning
    assert memory_report(cfg(), 4, False, None)[1] is None  # no GPU: nothing to compare with


@pytest.mark.parametrize("env, says", [({"PYTORCH_ALLOC_CONF": "expandable_segments:True"},
                                        ", with PYTORCH_ALLOC_CONF=expandable_segments:True"),
                                       ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:true,max_split_size_mb:64"},
                                        ", with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:true"),
                                       ({}, "the allocator's segments are fixed (no PYTORCH_ALLOC_CONF)"),
                                       ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"},
                                        "fixed (PYTORCH_ALLOC_CONF=max_split_size_mb:128)")])
def test_the_memory_report_says_which_allocator_it_assumed(monkeypatch, env, says):
    """The estimate leaves 15% for the allocator's fragmentation, which holds with expandable
    segments (what every rank gets unless launch.env says otherwise): the GPU line says which."""
    from common.layouts import ALLOC_CONF_NAMES, memory_report

    for name in ALLOC_CONF_NAMES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = from_dict(TrainerConfig, {"model": {"size": "tiny"}, "parallel": {"dp": 4}, "data": {"seq_len": 512}})
    line, _ = memory_report(cfg, 4, False, 80 * 10**9)
    assert says in line and "\n" not in line
    assert "PYTORCH" not in memory_report(cfg, 4, False, None)[0]  # on the CPU no allocator to speak of
