"""The GPU tier (`make test-gpu` = `pytest -m gpu`): one CUDA GPU, each test skips without one.

- bf16 training on the GPU against the fp32 CPU reference, same data and seed;
- flash-attn against SDPA (skips where flash-attn is not installed; fails where it is
  installed but does not import, as the trainer does);
- fused AdamW over DTensor parameters (tensor parallel and FSDP2 on a 1-GPU mesh);
- the real entry point under torchrun with one process: an NCCL process group, fp32;
- that run's checkpoint, saved on the GPU, resumed by a CPU-only process.

The file doubles as the worker script of its process-group test:
`torchrun --nproc-per-node 1 tests/test_gpu.py fused-adamw`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # when run as a worker script
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_helpers import TINY_MODEL, clean_env, read_metrics, tiny_config, write_run  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU: torch.cuda.is_available() is False here")]

HELPER = Path(__file__).resolve().parent / "trainer_helpers.py"

# bf16 autocast (fp32 weights and optimizer) against fp32, 20 steps of the tiny model: on the
# CPU's bf16 autocast the losses stay within 4.8e-4 relative of fp32; the GPU adds bf16
# attention kernels and fused AdamW. 5e-3 leaves 10x room and is still well under the
# 1-4% the loss moves per step, so a wrong scale or a dropped update shows.
BF16_LOSS_RTOL = 5e-3
# fp32 on the GPU against fp32 on the CPU: only kernels differ (the CPU layouts agree to
# 2e-7 over 8 steps). TF32 is switched off for that run: NGC images turn it on by default.
FP32_LOSS_RTOL = 1e-4
NO_TF32 = {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "0", "NVIDIA_TF32_OVERRIDE": "0"}


def _run(cmd: list[str], env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc


def cpu_only_env(**extra: str) -> dict[str, str]:
    return clean_env(CUDA_VISIBLE_DEVICES="", **extra)


def losses(run_dir: Path) -> dict[int, float]:
    from common.metrics_log import latest_by_step, read_metrics as history

    return {r["step"]: r["loss"] for r in latest_by_step(history(run_dir)) if r["kind"] == "train"}


# ---- bf16 on the GPU against fp32 on the CPU ------------------------------------------


def test_bf16_training_matches_the_fp32_cpu_reference(tmp_path):
    steps = {"steps": 20, "warmup_steps": 4}
    gpu = write_run(tmp_path, "gpu_bf16", tiny_config(train={**steps, "dtype": "bfloat16"}))
    cpu = write_run(tmp_path, "cpu_fp32", tiny_config(train={**steps, "dtype": "float32"}))
    on_gpu = _run([sys.executable, str(HELPER), str(gpu)], clean_env())
    on_cpu = _run([sys.executable, str(HELPER), str(cpu)], cpu_only_env())
    assert "on cuda:0 (no process group), torch.bfloat16" in on_gpu.stderr, on_gpu.stderr[-2000:]
    assert "on cpu (no process group), torch.float32" in on_cpu.stderr, on_cpu.stderr[-2000:]
    got, want = read_metrics(gpu.parent), read_metrics(cpu.parent)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 21))
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=BF16_LOSS_RTOL), f"step {g['step']}"
    assert want[0]["loss"] - want[-1]["loss"] > 0.3  # it learned, so the comparison means something


# ---- flash-attn against SDPA ------------------------------------------------------------


def _flash_or_skip():
    from trainer.model import import_flash_attn

    try:
        return import_flash_attn()
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "flash_attn":
            pytest.skip("flash-attn is not installed here (the image installs it)")
        raise  # flash-attn is installed but needs a module that is not: broken, and that is a failure


def test_flash_attn_matches_sdpa():
    """Forward and backward of one attention layer (GQA: 4 heads, 2 kv heads) under bf16
    autocast: flash-attn's error against an fp32 reference is no worse than SDPA's."""
    _flash_or_skip()
    from trainer.config import ModelSection
    from trainer.model import Attention, Transformer

    cfg = ModelSection(**{**TINY_MODEL, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 2,
                          "max_position_embeddings": 256})
    device = torch.device("cuda")
    rope = Transformer(cfg)  # its rotary tables
    cos, sin = rope.rope_cos.to(device), rope.rope_sin.to(device)
    torch.manual_seed(0)
    sdpa = Attention(cfg, "sdpa").to(device)
    flash = Attention(cfg, "flash").to(device)
    flash.load_state_dict(sdpa.state_dict())
    x_BTD = torch.randn(2, 200, cfg.hidden_size, device=device)

    def run(layer: Attention, autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = x_BTD.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = layer(x, cos, sin)
        out.float().pow(2).mean().backward()
        return out.float().detach(), x.grad.float()

    ref_out, ref_grad = run(sdpa, autocast=False)  # fp32 SDPA: the reference
    flash_out, flash_grad = run(flash, True)
    sdpa_out, sdpa_grad = run(sdpa, True)
    assert torch.isfinite(flash_out).all() and torch.isfinite(flash_grad).all()
    for got, sdpa_val, ref, what in ((flash_out, sdpa_out, ref_out, "output"),
                                    (flash_grad, sdpa_grad, ref_grad, "input gradient")):
        flash_err = (got - ref).abs().max().item()
        sdpa_err = (sdpa_val - ref).abs().max().item()
        scale = ref.abs().max().item()
        assert flash_err <= 2 * sdpa_err + 1e-3 * scale, f"{what}: flash error {flash_err}, SDPA {sdpa_err}"
        torch.testing.assert_close(got, sdpa_val, rtol=0.05, atol=0.02 * scale)


def test_auto_picks_flash_in_a_flash_image(monkeypatch):
    _flash_or_skip()
    from trainer.config import ModelSection
    from trainer.model import select_attention

    monkeypatch.setenv("SLIPWAY_FLASH_ATTN", "1")
    cfg = ModelSection(**TINY_MODEL)
    assert select_attention(cfg, torch.device("cuda", 0), torch.bfloat16) == "flash"
    assert select_attention(cfg, torch.device("cuda", 0), torch.float32) == "sdpa"


# ---- fused AdamW with DTensor parameters -------------------------------------------------


def test_fused_adamw_steps_dtensor_parameters():
    """Tensor parallel then FSDP2 on a 1 x 1 mesh of this GPU (the flagship's structure):
    every parameter is a DTensor; AdamW must be the fused kernel and step them as it steps the
    same model unsharded (bit for bit on an H200), and near foreach AdamW's steps."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", __file__,
           "fused-adamw"]
    out = _run(cmd, clean_env())
    assert "fused-adamw ok" in out.stdout, out.stdout[-2000:]


def _fused_adamw_worker() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from trainer.config import ModelSection, TrainSection
    from trainer.model import Transformer
    from trainer.optim import build_optimizer, clip_grad_norm_, param_groups
    from trainer.parallel import apply_fsdp, apply_tp, init_distributed
    from trainer.runners import cross_entropy

    env = init_distributed()  # torchrun, one process: a group of one, NCCL on CUDA
    assert dist.is_initialized() and dist.get_backend() == ("nccl" if env.device.type == "cuda" else "gloo")
    cfg = ModelSection(**TINY_MODEL)
    train_cfg = TrainSection(lr=1e-2, warmup_steps=0)
    with torch.device("meta"):
        sharded = Transformer(cfg)
    mesh = init_device_mesh(env.device.type, (1, 1), mesh_dim_names=("dp", "tp"))
    apply_tp(sharded, mesh["tp"], sequence_parallel=False)
    apply_fsdp(sharded, mesh["dp"], zero_stage=1, param_dtype=torch.float32)
    sharded.to_empty(device=env.device)
    sharded.init_weights(seed=0)
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
    opt = build_optimizer(sharded, train_cfg)
    kernels = {"fused": {"fused": True}, "foreach": {"foreach": True}}
    plains = {kernel: Transformer(cfg).to(env.device) for kernel in kernels}
    for model in plains.values():
        model.init_weights(seed=0)
    refs = {kernel: torch.optim.AdamW(param_groups(plains[kernel], train_cfg.weight_decay), lr=train_cfg.lr,
                                      betas=(train_cfg.beta1, train_cfg.beta2), eps=train_cfg.eps, **kw)
            for kernel, kw in kernels.items()}
    if env.device.type == "cuda":
        assert all(group.get("fused") for group in opt.param_groups), "AdamW fell back from the fused kernel"
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=gen).to(env.device)
        for model, optimizer in ((sharded, opt), *((plains[k], refs[k]) for k in kernels)):
            cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    got = {n: p.full_tensor() for n, p in sharded.named_parameters()}
    # Against the same kernel unsharded: only DTensor's dispatch differs (an H200: 0; the CPU: 7.5e-9).
    # Against foreach AdamW, another kernel: 1.2e-6 apart after these 3 steps at lr 1e-2 (an H200),
    # most in elements whose gradient is near eps; 1e-5 still catches a wrong update (lr-sized).
    for kernel, atol in (("fused", 1e-8), ("foreach", 1e-5)):
        for name, p in plains[kernel].named_parameters():
            torch.testing.assert_close(got[name], p, rtol=1e-6, atol=atol,
                                       msg=lambda text: f"{name} against {kernel} AdamW unsharded: {text}")
    dist.destroy_process_group()
    print("fused-adamw ok")


# ---- the entry point under torchrun: NCCL; its checkpoint resumed on the CPU -------------


@pytest.fixture(scope="module")
def nccl_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`torchrun --nproc-per-node 1 -m trainer --config ...`: the builtin corpus and tokenizer,
    fp32, 6 steps, checkpoints at 3 and 6."""
    root = tmp_path_factory.mktemp("nccl")
    cfg = tiny_config(model={"vocab_size": 4096}, train={"steps": 6, "warmup_steps": 1, "dtype": "float32"},
                      checkpoint={"interval": 3, "keep_last": 3})
    config = write_run(root / "runs", "gpu", cfg)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           "-m", "trainer", "--config", str(config)]
    return config.parent, _run(cmd, clean_env(**NO_TF32))


def test_the_trainer_runs_on_an_nccl_group(nccl_run):
    run_dir, proc = nccl_run
    log = proc.stdout + proc.stderr
    assert "world 1 = pp 1 x dp 1 x tp 1 on cuda:0 (nccl), torch.float32" in log, log[-3000:]
    assert sorted(losses(run_dir)) == [1, 2, 3, 4, 5, 6]
    from common.rundir import complete_checkpoints
    from trainer.checkpoint import step_dir

    assert complete_checkpoints(run_dir / "checkpoints") == [3, 6]
    meta = json.loads((step_dir(run_dir / "checkpoints", 6) / "COMPLETE").read_text())
    assert meta["world_size"] == 1 and meta["final"] is True


def test_a_gpu_checkpoint_resumes_on_the_cpu(nccl_run, tmp_path):
    """Step 3 of the GPU run (fused AdamW state, CUDA RNG state, NCCL world) resumes in a
    process that sees no GPU; steps 4-6 then follow the GPU run's within fp32 kernel noise."""
    from trainer.checkpoint import step_dir

    gpu_dir, _ = nccl_run
    cpu_dir = tmp_path / "runs" / "cpu"
    (cpu_dir / "checkpoints").mkdir(parents=True)
    shutil.copy(gpu_dir / "config.yaml", cpu_dir / "config.yaml")
    shutil.copytree(step_dir(gpu_dir / "checkpoints", 3), step_dir(cpu_dir / "checkpoints", 3))
    out = _run([sys.executable, "-m", "trainer", "--config", str(cpu_dir / "config.yaml")], cpu_only_env())
    assert "on cpu (no process group), torch.float32" in out.stderr and "resumed from step 3" in out.stderr
    gpu, cpu = losses(gpu_dir), losses(cpu_dir)
    assert sorted(cpu) == [4, 5, 6]
    for step in (4, 5, 6):
        assert cpu[step] == pytest.approx(gpu[step], rel=FP32_LOSS_RTOL), f"step {step}"
    assert abs(gpu[4] - gpu[6]) > 10 * FP32_LOSS_RTOL * gpu[4]  # the steps move more than the tolerance


if __name__ == "__main__":
    {"fused-adamw": _fused_adamw_worker}[sys.argv[1]]()
