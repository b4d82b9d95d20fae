"""Training throughput: our trainer against a bare PyTorch loop and torchtitan.

One run prints, side by side, steady-state tokens/s, model TFLOP/s, MFU (null
on CPU or an unknown GPU) and peak memory for:

  ours          `trainer.train.train` in one process (what `python -m trainer` runs),
                with its defaults: losses kept on the device between logged steps,
                batches read ahead, device-side non-finite skip, gc every 50 steps
  ours fsdp x2  the same under `torchrun --nproc-per-node 2`, dp=2 (FSDP2); opt-in
  bare          a plain loop on the same `trainer.model.Transformer`: same batch,
                fused AdamW, grad clipping, same dtype, compile and activation
                checkpointing; one host sync at the end of the timed steps
  torchtitan    torchtitan 0.3.0 on our torch (this environment, or .cache/bench-venv
                made over it), its llama3 trainer with the same model (dimensions,
                padded vocabulary, unfused q/k/v), batch, sequence length, dtype,
                compile and activation checkpointing, logging as often as ours;
                its logged tps parsed. Its SDPA row (the flash backend on CUDA, as
                ours) is the one compared; its flex attention is a separate row
                (--titan-flex, always with --matrix). It needs CUDA (it picks
                device cuda even without one), so on CPU it runs only with
                --torchtitan; --check-torchtitan checks its model on the CPU.

The overhead ratio is ours / bare tokens/s (1.00 = no overhead). FLOPs per
token follow torchtitan's convention (`trainer.model.num_flops_per_token`, the
padded vocabulary included) for every case. Every case runs in a fresh process
(peak memory is per case); the first `--warmup` steps are left out, and so is
each trainer's first logged window. The model is untied in every case
(torchtitan's llama3 has no tied embeddings). Ours reads the shipped corpus and
tokenizer where torchtitan runs (CUDA; what torchtitan reads), random tokens on
CPU (`--data`); the bare loop always random tokens. `make gpu-report`
(`--gpu-report`) runs the GPU tests and the matrix and writes them up.

    .venv/bin/python bench/trainer.py                       # CPU: a small model, ours vs bare
    .venv/bin/python bench/trainer.py --device cuda         # tiny (109M) at seq 512, bf16, eager
    .venv/bin/python bench/trainer.py --matrix              # CUDA: the issue-10 comparison, see below
    .venv/bin/python bench/trainer.py --compile --ac selective --no-torchtitan

`--matrix` (CUDA) runs the tiny preset at seq 512 (micro batch 16) and the ~1.1B
`base` preset at seq 2048 (micro batch 4), each eager and compiled, each without
and with selective (per-op) activation checkpointing: ours, torchtitan and bare
for every one of the 8 settings, in one table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
BENCH_VENV = ROOT / ".cache" / "bench-venv"
TORCHTITAN_VERSION = "0.3.0"

# Case defaults per device (a preset name or explicit dimensions). Both trainers log (and so
# wait for the device) every log_interval steps; the timed windows start after `warmup`.
CPU_DEFAULTS = dict(preset="custom", hidden=256, layers=4, heads=4, kv_heads=4, vocab=4096, ffn=None,
                    seq_len=256, micro_batch=8, steps=24, warmup=4, log_interval=4, dtype="float32")
CUDA_DEFAULTS = dict(preset="tiny", seq_len=512, micro_batch=16, steps=60, warmup=10, log_interval=10,
                     dtype="bfloat16")
# --matrix: (label, preset, seq_len, micro batch, steps) x (compile, activation checkpointing).
MATRIX_MODELS = (("tiny 109M", "tiny", 512, 16, 60), ("base 1.1B", "base", 2048, 4, 40))
MATRIX_VARIANTS = ((False, "none"), (True, "none"), (False, "selective"), (True, "selective"))


# --------------------------------------------------------------------------
# The model config every case shares.
# --------------------------------------------------------------------------


def model_dict(args: argparse.Namespace) -> dict[str, Any]:
    """The `model:` section for trainer configs (a preset, with any dimension overridden)."""
    from trainer.config import MODEL_PRESETS

    base = dict(MODEL_PRESETS.get(args.preset, {}))
    overrides = dict(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                     num_kv_heads=args.kv_heads, vocab_size=args.vocab, intermediate_size=args.ffn)
    base.update({k: v for k, v in overrides.items() if v is not None})
    if base.get("intermediate_size") is None:
        base["intermediate_size"] = 2 * base["hidden_size"]  # the tiny preset's ratio
    if base.get("num_kv_heads") is None:
        base["num_kv_heads"] = base["num_heads"]
    base["max_position_embeddings"] = max(args.seq_len, base.get("max_position_embeddings") or 0)
    base["tie_embeddings"] = False  # torchtitan's llama3 cannot tie them: the same model everywhere
    base["size"] = "custom"
    base["init_std"] = 0.02
    base["attention"] = getattr(args, "attention", "sdpa")
    return base


def trainer_config(args: argparse.Namespace, dp: int) -> dict[str, Any]:
    return {
        "run": {"name": "bench", "seed": 0},
        "model": model_dict(args),
        "parallel": {"dp": dp, "tp": 1, "pp": 1, "dp_mode": "fsdp", "zero_stage": 1},
        "data": {"dataset": "builtin", "tokenizer": "builtin", "seq_len": args.seq_len},
        "train": {"steps": args.steps, "micro_batch_size": args.micro_batch, "grad_accum_steps": 1,
                  "lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 0, "decay": "constant", "dtype": args.dtype,
                  "compile": args.compile, "activation_checkpointing": args.ac, "eval_interval": 0},
        "checkpoint": {"interval": 10**9, "keep_last": 1},
        "logging": {"interval": args.log_interval},
    }


class RandomTokens:
    """A Sampler of uniformly random tokens (the model cannot tell, the timing does not care)."""

    def __init__(self, vocab: int, batch: int, seq_len: int, seed: int):
        import torch

        self.gen = torch.Generator().manual_seed(seed)
        self.vocab, self.shape = vocab, (batch, seq_len + 1)
        self.consumed = 0

    def next_batch(self):
        import torch

        self.consumed += 1
        tokens = torch.randint(0, self.vocab, self.shape, generator=self.gen)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])


def random_data(cfg, run_dir, dp_rank, dp_size):
    return (RandomTokens(cfg.model.vocab_size, cfg.train.micro_batch_size, cfg.data.seq_len, 1 + dp_rank),
            None, cfg.model.vocab_size)


# --------------------------------------------------------------------------
# Cases. Each runs in its own process and prints one JSON line: RESULT {...}.
# --------------------------------------------------------------------------


def steady(records: list[dict], warmup: int) -> dict[str, Any]:
    """Tokens/s etc. over the logged windows that start at or after step `warmup`. A record
    covers the steps since the one before it (the trainer logs every log_interval steps, and
    an attempt's first step as a warm-up without throughput)."""
    records = sorted(records, key=lambda r: r["step"])
    windows = [(r["step"] - prev["step"], r) for prev, r in zip(records, records[1:])
               if prev["step"] >= warmup and r["tokens_per_s"] is not None]
    if not windows:
        raise ValueError(f"no logged window starts at or after step {warmup}: raise --steps or lower --warmup")
    elapsed = sum(n * r["step_time_s"] for n, r in windows)
    tokens = sum(n * r["step_time_s"] * r["tokens_per_s"] for n, r in windows)
    steps = sum(n for n, _ in windows)
    return {"steps_timed": steps, "step_time_s": elapsed / steps, "tokens_per_s": tokens / elapsed,
            "peak_memory_gib": max(r["peak_memory_gib"] for r in records)}


def sdpa_flash_only(args: argparse.Namespace) -> None:
    """CUDA, 16-bit: SDPA's flash backend alone, the kernel torchtitan's SDPA row is given too (the
    default order may pick cuDNN or memory-efficient attention); a shape it cannot run fails loudly."""
    import torch

    if args.device == "cuda" and args.dtype != "float32" and args.attention == "sdpa":
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_math_sdp(False)
        torch.backends.cuda.enable_flash_sdp(True)


def case_ours(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from common.schema import from_dict
    from trainer.config import TrainerConfig
    from trainer.train import train

    world = int(os.environ.get("WORLD_SIZE", "1"))
    raw = trainer_config(args, dp=world)
    if args.hang_timeout is not None:  # --watchdog-cost: the hang watchdog (trainer/watchdog.py) off with 0
        raw["train"]["hang_timeout"] = args.hang_timeout
    cfg = from_dict(TrainerConfig, raw)
    sdpa_flash_only(args)
    run_dir = Path(tempfile.mkdtemp(prefix="slipway-bench-trainer-")) if world == 1 else Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        data = None if args.data == "builtin" else random_data
        if args.data == "builtin":  # the shipped tokenizer's cache lives with the bench, not in runs/
            cfg.data.cache_dir = str(ROOT / ".cache" / "bench-data")
        train(cfg, run_dir, data=data)
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        if rank != 0:
            return {}
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        records = [r for r in records if r.get("kind") == "train"]
        out = steady(records, args.warmup)
        out["tokens_per_s_per_device"] = out["tokens_per_s"] / world
        out["processes"] = world
        out["peak_reserved_gib"] = _peak_reserved(args)
        return out
    finally:
        if world == 1:
            shutil.rmtree(run_dir, ignore_errors=True)


def _peak_reserved(args: argparse.Namespace) -> Optional[float]:
    """CUDA: the caching allocator's peak reservation (what torchtitan reports); None on CPU."""
    import torch

    return torch.cuda.max_memory_reserved() / 2**30 if args.device == "cuda" else None


def case_bare(args: argparse.Namespace) -> dict[str, Any]:
    """The least a training step can do on the same model: no trainer in the way. The same
    compile and activation checkpointing as ours (they change the model, not the loop)."""
    import torch
    import torch.nn.functional as F

    from trainer.compute import apply_ac
    from common.schema import from_dict
    from trainer.config import ModelSection
    from trainer.metrics import peak_memory_gib
    from trainer.model import Transformer, select_attention

    device = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    sdpa_flash_only(args)
    mcfg = from_dict(ModelSection, model_dict(args))
    torch.manual_seed(0)
    model = Transformer(mcfg, select_attention(mcfg, device, dtype)).to(device)
    apply_ac(model, args.ac, "op")
    if args.compile:
        for layer in model.layers.values():
            layer.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    data = RandomTokens(mcfg.vocab_size, args.micro_batch, args.seq_len, 1)
    autocast = dtype != torch.float32

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    losses = []
    for step in range(args.steps):
        if step == args.warmup:  # the timed steps: no host sync until they are all done
            sync()
            t0 = time.perf_counter()
        inputs, targets = (t.to(device, non_blocking=True) for t in data.next_batch())
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    torch.stack(losses).tolist()  # the loop is done when its losses are known
    elapsed = time.perf_counter() - t0
    timed = args.steps - args.warmup
    tokens = args.micro_batch * args.seq_len * timed
    return {"steps_timed": timed, "step_time_s": elapsed / timed, "tokens_per_s": tokens / elapsed,
            "tokens_per_s_per_device": tokens / elapsed, "peak_memory_gib": peak_memory_gib(device),
            "peak_reserved_gib": _peak_reserved(args), "processes": 1}


def run_case_here(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT))
    result = {"ours": case_ours, "bare": case_bare}[args.case](args)
    if result:
        print("RESULT " + json.dumps(result), flush=True)
    return 0


# --------------------------------------------------------------------------
# torchtitan, in its own venv, through its own entry point.
# --------------------------------------------------------------------------

# A config module for torchtitan's ConfigManager (`--module slipway_titan --config slipway_llama`):
# its llama3 model config with our dimensions and our padded vocabulary, separate q/k/v
# projections (ours has no fused QKV), plain causal SDPA (its flash backend on CUDA, as
# ours) or, for the separate row, its own flex attention; fp32/bf16 like ours, the shipped
# corpus and tokenizer (ours reads them too: --data builtin), no checkpoints, no
# validation; compile (the model only: ours compiles the blocks, not the loss) and
# activation checkpointing as ours (torchtitan's default is selective AC: it is set
# explicitly, None for none), logging as often as ours.
TITAN_MODULE = """
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import default_adamw, LRSchedulersContainer
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets import text_datasets
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import _build_llama3_layers, _EMBEDDING_INIT, _NORM_INIT, _output_linear_init
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.model import Llama3Model
from torchtitan.trainer import Trainer

P = {params!r}

if P["attention"] == "sdpa" and P["flash_backend"]:
    # The same kernel as ours: SDPA's flash backend alone (torchtitan's default order puts cuDNN first).
    from torch.nn.attention import SDPBackend
    ScaledDotProductAttention.sdpa_backends = [SDPBackend.FLASH_ATTENTION]

from datasets import load_dataset
text_datasets.DATASETS["slipway_builtin"] = DatasetConfig(
    path=P["corpus"], loader=lambda path: load_dataset("json", data_files=path, split="train"),
    sample_processor=lambda sample: sample["text"])


def slipway_llama():
    dim, heads, vocab = P["dim"], P["heads"], P["vocab"]
    layers = _build_llama3_layers(
        fuse_qkv=False, n_layers=P["layers"], dim=dim, n_heads=heads, n_kv_heads=P["kv_heads"],
        hidden_dim=P["ffn"],
        rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=P["seq_len"], theta=10000.0, scaling="none"),
        attn_backend="flex")
    if P["attention"] == "sdpa":  # plain causal SDPA, as ours: no per-document masks (the trainer builds none)
        for layer in layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model = Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=layers,
    )
    spec = model_registry("debugmodel")
    spec.model, spec.flavor = model, "slipway"
    if P.get("count_only"):  # the CPU check: the model's parameter count, built on the meta device
        import torch
        with torch.device("meta"):
            built = model.build()
        print("TITAN_PARAMS", sum(p.numel() for p in built.parameters()), flush=True)
    return Trainer.Config(
        loss=CrossEntropyLoss.Config(global_vocab_size=vocab),
        hf_assets_path=P["assets"],
        model_spec=spec,
        optimizer=default_adamw(lr=3e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=1, decay_ratio=None),
        training=TrainingConfig(local_batch_size=P["batch"], seq_len=P["seq_len"], steps=P["steps"],
                                dtype="float32", mixed_precision_param=P["dtype"]),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="slipway_builtin"),
        metrics=MetricsProcessor.Config(log_freq=P["log_freq"]),
        parallelism=ParallelismConfig(),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint={{"none": None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}}[P["ac"]],
        compile=CompileConfig(enable=P["compile"], components=["model"]),  # ours compiles the blocks, not the loss
        dump_folder=P["dump"],
    )
"""

TPS_LINE = re.compile(r"step:\s*(\d+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+).*?tflops:\s*([\d,.]+).*?mfu:\s*(\S+)")


def titan_python(args: argparse.Namespace) -> tuple[Optional[Path], str]:
    """A python with torchtitan importable on the very torch ours runs on, or None and why not:
    this one if it has torchtitan, else the bench venv, made on top of this environment
    (--system-site-packages: its torch, the image's on a GPU machine; only torchtitan and what
    it needs besides torch go into the venv)."""
    import torch

    check = "import torchtitan, torch; print(torch.__version__)"
    here = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    if here.returncode == 0:
        return Path(sys.executable), ""
    python = BENCH_VENV / "bin" / "python"
    got = subprocess.run([str(python), "-c", check], capture_output=True, text=True) if python.exists() else None
    if got is not None and got.returncode == 0 and got.stdout.strip() == torch.__version__:
        return python, ""
    if args.no_install:
        return None, f"not installed in {BENCH_VENV.relative_to(ROOT)} (--no-install)"
    print(f"installing torchtitan {TORCHTITAN_VERSION} into {BENCH_VENV.relative_to(ROOT)} over this torch "
          f"{torch.__version__} ...", file=sys.stderr)
    shutil.rmtree(BENCH_VENV, ignore_errors=True)  # a venv of another torch (the bench once pinned its own)
    steps = [[sys.executable, "-m", "venv", "--system-site-packages", str(BENCH_VENV)],
             # torchtitan imports triton unconditionally; CPU torch wheels do not pull it in
             [str(python), "-m", "pip", "install", "-q", f"torchtitan=={TORCHTITAN_VERSION}", "triton",
              f"torch=={torch.__version__}"]]
    for step in steps:
        proc = subprocess.run(step, capture_output=True, text=True)
        if proc.returncode != 0:
            return None, f"install failed: {first_error(proc.stdout + proc.stderr)}"
    got = subprocess.run([str(python), "-c", check], capture_output=True, text=True)
    if got.stdout.strip() != torch.__version__:
        return None, f"the bench venv's torch is {got.stdout.strip() or 'missing'}, not ours ({torch.__version__})"
    return python, ""


def titan_params(args: argparse.Namespace, attention: str, work: Path) -> dict[str, Any]:
    """What the torchtitan config module reads: our model's dimensions and padded vocabulary."""
    from common.schema import from_dict
    from trainer.config import ModelSection

    mcfg = from_dict(ModelSection, model_dict(args))
    return dict(dim=mcfg.hidden_size, heads=mcfg.num_heads, kv_heads=mcfg.num_kv_heads, layers=mcfg.num_layers,
                vocab=mcfg.padded_vocab_size, ffn=mcfg.intermediate_size, seq_len=args.seq_len,
                batch=args.micro_batch, steps=args.steps, dtype=args.dtype, compile=args.compile, ac=args.ac,
                log_freq=args.log_interval, attention=attention,
                flash_backend=args.device == "cuda" and args.dtype != "float32",
                corpus=str(ROOT / "trainer" / "assets" / "corpus.jsonl.gz"), assets=str(work / "assets"),
                dump=str(work / "dump"))


def check_torchtitan_model(args: argparse.Namespace) -> tuple[Optional[int], str]:
    """The CPU check: torchtitan's config module loads and builds (on the meta device) the model
    ours trains: (its parameter count or None, the output)."""
    python, why = titan_python(args)
    if python is None:
        return None, why
    work = Path(tempfile.mkdtemp(prefix="slipway-bench-titan-check-"))
    try:
        params = {**titan_params(args, "sdpa", work), "count_only": True}
        (work / "slipway_titan.py").write_text(TITAN_MODULE.format(params=params))
        proc = subprocess.run([str(python), "-c", "import slipway_titan; slipway_titan.slipway_llama()"], cwd=work,
                              env={**os.environ, "PYTHONPATH": str(work), "HF_HUB_OFFLINE": "1",
                                   "HF_DATASETS_OFFLINE": "1"}, capture_output=True, text=True, timeout=args.timeout)
        m = re.search(r"^TITAN_PARAMS (\d+)$", proc.stdout, re.M)
        return (int(m[1]) if m else None), proc.stdout + proc.stderr
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_torchtitan(args: argparse.Namespace, attention: str = "sdpa") -> tuple[Optional[dict], str]:
    python, why = titan_python(args)
    if python is None:
        return None, why
    work = Path(tempfile.mkdtemp(prefix="slipway-bench-titan-"))
    try:
        assets = work / "assets"
        assets.mkdir()
        shutil.copy(ROOT / "trainer" / "assets" / "tokenizer.json", assets / "tokenizer.json")
        params = titan_params(args, attention, work)
        (work / "slipway_titan.py").write_text(TITAN_MODULE.format(params=params))
        argv = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                "-m", "torchtitan.train", "--module", "slipway_titan", "--config", "slipway_llama"]
        env = {"PYTHONPATH": str(work), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_DATASETS_CACHE": str(work / "hf-datasets")}
        if args.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        try:
            proc = subprocess.run(argv, cwd=work, env={**os.environ, **env}, capture_output=True, text=True,
                                  timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return None, f"timed out after {args.timeout:.0f}s"
        output = proc.stdout + proc.stderr
        rows = []
        for line in re.sub(r"\x1b\[[0-9;]*m", "", output).splitlines():
            m = TPS_LINE.search(line)
            if m:
                rows.append(dict(step=int(m[1]), mem=float(m[2]), tps=float(m[3].replace(",", "")),
                                 tflops=float(m[4].replace(",", "")), mfu=m[5]))
        if proc.returncode != 0 or not rows:
            if os.environ.get("SLIPWAY_BENCH_KEEP"):
                print(output[-6000:], file=sys.stderr)
            reason = titan_error(output)
            if "_cuda_setDevice" in reason or "Torch not compiled with CUDA" in reason:
                reason = (f"torchtitan {TORCHTITAN_VERSION} needs CUDA: without an accelerator it still picks device "
                          f"'cuda' (torchtitan/tools/utils.py) and fails in Trainer.__init__ ({reason})")
            return None, reason
        # tps of each logged window (log_freq steps since the previous line); the steady figure is
        # tokens over time across the windows that start at or after --warmup, as for ours.
        windows = [(r["step"] - prev["step"], r) for prev, r in zip(rows, rows[1:]) if prev["step"] >= args.warmup]
        if not windows:
            return None, f"no logged window starts at or after step {args.warmup}: raise --steps"
        tokens = args.micro_batch * args.seq_len
        tps = sum(n * tokens for n, _ in windows) / sum(n * tokens / r["tps"] for n, r in windows)
        last = windows[-1][1]
        mfu = None if last["mfu"] in ("N/A", "n/a") else float(last["mfu"].rstrip("%")) / 100
        version = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True,
                                 text=True).stdout.strip()
        return {"steps_timed": sum(n for n, _ in windows), "tokens_per_s": tps, "tokens_per_s_per_device": tps,
                "peak_memory_gib": None, "peak_reserved_gib": max(r["mem"] for r in rows), "processes": 1,
                "titan_mfu": mfu, "torch": version}, output
    finally:
        if not os.environ.get("SLIPWAY_BENCH_KEEP"):
            shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------
# The driver: start each case, collect, print.
# --------------------------------------------------------------------------


def case_argv(args: argparse.Namespace, case: str) -> list[str]:
    argv = [str(Path(__file__).resolve()), "--case", case, "--device", args.device, "--preset", args.preset,
            "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--log-interval", str(args.log_interval), "--dtype", args.dtype,
            "--data", args.data, "--ac", args.ac, "--attention", args.attention]
    for flag, value in (("--hidden", args.hidden), ("--layers", args.layers), ("--heads", args.heads),
                        ("--kv-heads", args.kv_heads), ("--vocab", args.vocab), ("--ffn", args.ffn)):
        if value is not None:
            argv += [flag, str(value)]
    if args.compile:
        argv.append("--compile")
    return argv


def run_subprocess(argv: list[str], timeout: float, env: Optional[dict] = None) -> tuple[Optional[dict], str]:
    """(the RESULT json or None, the output's tail)."""
    try:
        proc = subprocess.run(argv, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, f"timed out after {timeout:.0f}s\n{out[-2000:]}"
    output = proc.stdout + proc.stderr
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):]), output
    return None, f"exit {proc.returncode}\n{output[-3000:]}"


def run_ours_fsdp2(args: argparse.Namespace) -> tuple[Optional[dict], str]:
    run_dir = Path(tempfile.mkdtemp(prefix="slipway-bench-fsdp-"))
    try:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                *case_argv(args, "ours"), "--run-dir", str(run_dir)]
        return run_subprocess(argv, args.timeout)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def titan_error(output: str) -> str:
    """The root cause in a torchrun failure: the child's last exception line, not torchrun's."""
    lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", output).splitlines()]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b", ln) and "ChildFailedError" not in ln]
    return (errors[-1] if errors else first_error(output))[:300]


def first_error(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"(Error|Exception|error:)", ln):
            return ln[:300]
    return (lines[-1] if lines else "no output")[:300]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda if available, else cpu")
    parser.add_argument("--preset", default=None, help="tiny|small|base|large (trainer.config.MODEL_PRESETS) "
                        "or custom; CPU default: custom 256x4")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--ffn", type=int, help="intermediate size (default: the preset's, or 2 x hidden)")
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--micro-batch", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int, help="leading steps left out of the figures")
    parser.add_argument("--log-interval", type=int, help="steps between logged (host-synced) steps, ours and "
                        "torchtitan's; CPU default 4, CUDA 10")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="CPU default float32, CUDA bfloat16")
    parser.add_argument("--data", choices=("synthetic", "builtin"), default=None,
                        help="ours: random tokens, or the shipped corpus and tokenizer (what torchtitan reads: "
                             "the default where torchtitan runs, CUDA; synthetic on CPU); bare: always random")
    parser.add_argument("--attention", choices=("sdpa", "flash", "auto"), default="sdpa",
                        help="ours and bare: model.attention; sdpa (default) is torchtitan's SDPA row's kernel "
                             "(SDPA's flash backend on CUDA)")
    parser.add_argument("--titan-flex", action="store_true",
                        help="also torchtitan with its own flex attention, a separate row (--matrix: always)")
    parser.add_argument("--gpu-report", action="store_true",
                        help="only this (CUDA): the GPU tests and --matrix, written as a BENCHMARKS.md section with "
                             "the device and the date to --report (`make gpu-report`)")
    parser.add_argument("--report", type=Path, default=None,
                        help="where --gpu-report writes (default gpu-report-DATE.md here)")
    parser.add_argument("--check-torchtitan", action="store_true",
                        help="only this (CPU is enough): torchtitan's config module loads and builds the same model "
                             "(parameter count) as ours")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block (every case)")
    parser.add_argument("--ac", choices=("none", "selective", "full"), default="none",
                        help="activation checkpointing (every case; selective = per op)")
    parser.add_argument("--matrix", action="store_true", help="CUDA: tiny at seq 512 and base (1.1B) at seq 2048, "
                        "each eager/compiled x no/selective activation checkpointing, ours, bare and torchtitan")
    parser.add_argument("--fsdp2", action="store_true", help="also run ours on 2 processes, dp=2 (FSDP2)")
    parser.add_argument("--no-torchtitan", action="store_true", help="skip torchtitan")
    parser.add_argument("--torchtitan", action="store_true", help="try torchtitan on CPU too (it needs CUDA)")
    parser.add_argument("--no-install", action="store_true",
                        help="use .cache/bench-venv only if it exists; never pip install")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for every case (CPU: torchrun's default "
                        "is 1 per process; a busy machine gives steadier figures at 1)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per case")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--case", choices=("ours", "bare"), help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--watchdog-cost", type=int, default=0, metavar="N",
                        help="only this: ours N times with the hang watchdog on and N times off, alternating; "
                             "the ratio of their tokens/s")
    parser.add_argument("--hang-timeout", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.device is None:
        try:
            import torch
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            args.device = "cpu"
    if args.gpu_report:
        import datetime
        if args.device != "cuda":
            parser.error("--gpu-report measures on a GPU: no CUDA device here; run it on a GPU machine (make gpu-report)")
        args.matrix = True
        args.report = args.report or Path(f"gpu-report-{datetime.date.today().isoformat()}.md")
    if args.matrix and args.device != "cuda":
        parser.error("--matrix compares GPU runs (compile, bf16, torchtitan): it needs --device cuda")
    if args.matrix:
        args.titan_flex = True
    apply_defaults(args)
    if args.data is None:
        args.data = "builtin" if args.device == "cuda" and not args.no_torchtitan else "synthetic"
    if args.check_torchtitan:
        return drive_check_torchtitan(args)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by every case's process
    if args.case:
        return run_case_here(args)
    if args.watchdog_cost:
        return drive_watchdog_cost(args)
    if args.gpu_report:
        return drive_gpu_report(args)
    if args.matrix:
        return drive_matrix(args)
    return drive(args)


def drive_check_torchtitan(args: argparse.Namespace) -> int:
    """torchtitan's config module, as the comparison writes it, builds the model ours trains: the same
    parameter count (the same dimensions, untied, padded vocabulary, unfused q/k/v)."""
    sys.path.insert(0, str(ROOT))
    from common.schema import from_dict
    from trainer.config import ModelSection

    ours = from_dict(ModelSection, model_dict(args)).num_params()
    titan, output = check_torchtitan_model(args)
    if titan is None:
        print(f"torchtitan check FAILED: {titan_error(output) if chr(10) in output else output}", file=sys.stderr)
        return 1
    same = titan == ours
    print(f"torchtitan {TORCHTITAN_VERSION} config module loads; parameters: ours {ours:,}, torchtitan {titan:,}"
          f" ({'the same' if same else 'DIFFERENT'})")
    return 0 if same else 1


def drive_watchdog_cost(args: argparse.Namespace) -> int:
    """--watchdog-cost N: ours N times with the hang watchdog on (the default train.hang_timeout: its
    thread, the step marks, rank 0's progress.json) and N times off (train.hang_timeout 0),
    alternating so that the machine's drift falls on both; the ratio of the medians, 1.00 for none."""
    import statistics

    sys.path.insert(0, str(ROOT))
    rates: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(args.watchdog_cost):
        for label, extra in (("on", []), ("off", ["--hang-timeout", "0"])):
            result, output = run_subprocess([sys.executable, *case_argv(args, "ours"), *extra], args.timeout)
            if result is None:
                print(f"ours, watchdog {label}: not run: {first_error(output)}", file=sys.stderr)
                return 1
            rates[label].append(result["tokens_per_s"])
            print(f"  ours, watchdog {label} (run {i + 1}): {result['tokens_per_s']:,.0f} tok/s", file=sys.stderr,
                  flush=True)
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    pairs = ", ".join(f"{a / b:.3f}" for a, b in zip(rates["on"], rates["off"]))
    print(f"hang watchdog cost: on / off = {on / off:.3f} (medians of {args.watchdog_cost} runs each: {on:,.0f} vs "
          f"{off:,.0f} tokens/s; run by run {pairs})")
    if args.json:
        args.json.write_text(json.dumps({"watchdog_on": rates["on"], "watchdog_off": rates["off"],
                                         "ratio_of_medians": on / off}, indent=1))
    return 0


def apply_defaults(args: argparse.Namespace) -> None:
    defaults = CUDA_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    if args.preset is not None and args.preset != "custom" and args.device == "cpu":
        defaults = {**defaults, "hidden": None, "layers": None, "heads": None, "kv_heads": None, "vocab": None}
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def fmt(value: Any, spec: str) -> str:
    return "null" if value is None else format(value, spec)


def describe(args: argparse.Namespace, flops_per_token: int) -> str:
    import torch

    from common.schema import from_dict
    from trainer.config import ModelSection

    mcfg = from_dict(ModelSection, model_dict(args))
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({os.cpu_count()} cores)"
    return (f"model: hidden {mcfg.hidden_size}, ffn {mcfg.intermediate_size}, {mcfg.num_layers} layers, "
            f"{mcfg.num_heads} heads ({mcfg.num_kv_heads} kv), vocab {mcfg.vocab_size} (padded {mcfg.padded_vocab_size} "
            f"in ours), untied, {mcfg.num_params() / 1e6:.1f}M params; micro batch {args.micro_batch} x seq "
            f"{args.seq_len}, {args.dtype}, {args.steps} steps ({args.warmup} warmup left out, logged every "
            f"{args.log_interval}), data {args.data}; {device_name}, OMP_NUM_THREADS "
            f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; torch {torch.__version__}; "
            f"{flops_per_token / 1e6:.1f} MFLOP/token")


def run_cases(args: argparse.Namespace) -> list[tuple[str, Optional[dict], str]]:
    """ours, (ours x2), bare, torchtitan for one setting; each (name, result or None, output or reason)."""
    cases: list[tuple[str, Optional[dict], str]] = []

    def add(name: str, result: Optional[dict], output: str) -> None:
        cases.append((name, result, output))
        setting = f"compile {'on' if args.compile else 'off'}, ac {args.ac}"
        if result is None:
            reason = first_error(output) if "\n" in output else output
            reason = reason if reason.startswith("not run") else f"not run: {reason}"
            print(f"  {name} ({setting}): {reason}", file=sys.stderr, flush=True)
        else:
            print(f"  {name} ({setting}): {result['tokens_per_s']:,.0f} tok/s", file=sys.stderr, flush=True)

    add("ours (1 process)", *run_subprocess([sys.executable, *case_argv(args, "ours")], args.timeout))
    if args.fsdp2:
        add("ours (2 processes, fsdp dp=2)", *run_ours_fsdp2(args))
    add("bare PyTorch loop", *run_subprocess([sys.executable, *case_argv(args, "bare")], args.timeout))
    # Its SDPA row first: the one ours is compared with (the same kernel); flex, its default, apart.
    for attention in ("sdpa", "flex") if args.titan_flex else ("sdpa",):
        name = f"torchtitan {TORCHTITAN_VERSION} ({attention})"
        if args.no_torchtitan:
            add(name, None, "not run: --no-torchtitan")
        elif args.device == "cpu" and not args.torchtitan:
            add(name, None, f"not run: torchtitan {TORCHTITAN_VERSION} needs CUDA (it picks device cuda even without "
                            "one and fails in Trainer.__init__); --torchtitan tries anyway")
        else:
            add(name, *run_torchtitan(args, attention))
    return cases


def table_rows(cases: list[tuple[str, Optional[dict], str]], flops_per_token: int, peak: Optional[float],
               prefix: str = "") -> tuple[list[str], list[dict]]:
    """Printed rows and JSON records: each case against bare (ours/bare = the overhead) and
    against torchtitan (ours/torchtitan > 1: ours is faster)."""
    bare = next((r for n, r, _ in cases if n.startswith("bare")), None)
    titan = next((r for n, r, _ in cases if n.startswith("torchtitan")), None)
    lines, records = [], []
    for name, r, output in cases:
        if r is None:
            reason = output if "\n" not in output else first_error(output)
            reason = reason if reason.startswith("not run") else f"not run: {reason}"
            lines.append(f"| {prefix}{name:<32} | {reason} |")
            records.append({"case": name, "not_run": reason})
            continue
        per_dev = r["tokens_per_s_per_device"]
        tflops = flops_per_token * per_dev / 1e12
        mfu = tflops * 1e12 / peak if peak else None
        vs_bare = per_dev / bare["tokens_per_s"] if bare else None
        vs_titan = per_dev / titan["tokens_per_s_per_device"] if titan else None
        lines.append(f"| {prefix}{name:<32} | {r['tokens_per_s']:>10,.0f} | {per_dev:>10,.0f} | {tflops:>11.4f} | "
                     f"{fmt(mfu and 100 * mfu, '5.1f'):>6} | {fmt(r.get('peak_memory_gib'), '.2f'):>10} | "
                     f"{fmt(r.get('peak_reserved_gib'), '.2f'):>9} | {fmt(vs_bare, '.3f'):>7} | "
                     f"{fmt(vs_titan, '.3f'):>7} |")
        records.append({"case": name, **r, "tflops_per_device": tflops, "mfu": mfu, "vs_bare": vs_bare,
                        "vs_torchtitan": vs_titan})
    return lines, records


HEADER = (f"| {'case':<32} | {'tokens/s':>10} | {'tok/s/dev':>10} | {'TFLOP/s/dev':>11} | {'MFU %':>6} | "
          f"{'alloc GiB':>10} | {'resv GiB':>9} | {'vs bare':>7} | {'vs titan':>7} |")
MEMORY_NOTE = ("peak memory: alloc = CUDA max allocated (ours, bare; on CPU the max RSS), resv = CUDA max reserved "
               "(all three: torchtitan logs only that).")


def print_header(prefix_width: int = 0, prefix: str = "") -> None:
    header = HEADER.replace("| ", f"| {prefix:<{prefix_width}}", 1) if prefix_width else HEADER
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")


def drive(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT))
    import torch

    from common.schema import from_dict
    from trainer.config import ModelSection
    from trainer.metrics import peak_flops
    from trainer.model import num_flops_per_token

    flops_per_token = num_flops_per_token(from_dict(ModelSection, model_dict(args)), args.seq_len)
    peak = peak_flops(torch.device(args.device)) if args.device == "cuda" else None
    print(describe(args, flops_per_token) + f"; compile {'on' if args.compile else 'off'}, activation "
          f"checkpointing {args.ac}", flush=True)
    cases = run_cases(args)
    lines, records = table_rows(cases, flops_per_token, peak)
    print()
    print_header()
    print("\n".join(lines))
    ours, bare = cases[0][1], next(r for n, r, _ in cases if n.startswith("bare"))
    if ours and bare:
        print(f"\ntrainer overhead: ours / bare = {ours['tokens_per_s'] / bare['tokens_per_s']:.3f} "
              f"(step {1e3 * ours['step_time_s']:.1f} ms vs {1e3 * bare['step_time_s']:.1f} ms)")
    print(MEMORY_NOTE)
    if args.json:
        args.json.write_text(json.dumps({"flops_per_token": flops_per_token, "cases": records}, indent=1))
    return 0 if ours else 1


def drive_matrix(args: argparse.Namespace) -> int:
    """The GPU comparison of issue 10 in one table: MATRIX_MODELS x MATRIX_VARIANTS, ours,
    bare and torchtitan on each."""
    sys.path.insert(0, str(ROOT))
    import torch

    from common.schema import from_dict
    from trainer.config import ModelSection
    from trainer.metrics import peak_flops
    from trainer.model import num_flops_per_token

    peak = peak_flops(torch.device("cuda"))
    all_lines, all_records, ok = [], [], True
    for label, preset, seq_len, micro_batch, steps in MATRIX_MODELS:
        for compiled, ac in MATRIX_VARIANTS:
            one = argparse.Namespace(**{**vars(args), "preset": preset, "seq_len": seq_len,
                                        "micro_batch": micro_batch, "steps": steps, "compile": compiled, "ac": ac,
                                        "hidden": None, "layers": None, "heads": None, "kv_heads": None,
                                        "vocab": None, "ffn": None})
            flops_per_token = num_flops_per_token(from_dict(ModelSection, model_dict(one)), seq_len)
            print(f"[{label}] " + describe(one, flops_per_token) + f"; compile {'on' if compiled else 'off'}, "
                  f"activation checkpointing {ac}", flush=True)
            cases = run_cases(one)
            ok = ok and cases[0][1] is not None
            setting = f"{label}, {'compiled' if compiled else 'eager'}, ac {ac}: "
            lines, records = table_rows(cases, flops_per_token, peak, prefix=setting.ljust(36))
            all_lines += lines
            all_records += [{"model": label, "compile": compiled, "ac": ac, **r} for r in records]
    print()
    print_header(36, "model, mode, activation checkpointing: ")
    print("\n".join(all_lines))
    print(MEMORY_NOTE)
    if args.json:
        args.json.write_text(json.dumps({"cases": all_records}, indent=1))
    args.matrix_out = (all_lines, all_records)
    return 0 if ok else 1


# The issue-20 targets on one H100: ours / torchtitan (its SDPA row) tokens/s, and MFU.
TARGETS = {"tiny 109M": (1.1, 0.40), "base 1.1B": (1.0, 0.45)}


def drive_gpu_report(args: argparse.Namespace) -> int:
    """GPU readiness in one command (`make gpu-report`): the GPU tests, then the matrix against
    torchtitan, written with the device and the date as a BENCHMARKS.md section (args.report)."""
    import datetime
    import io
    import torch
    from contextlib import redirect_stdout

    if not torch.cuda.is_available():
        print("gpu-report: no CUDA device here: run it on a GPU machine (in the image: `make gpu-report`)",
              file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py"], cwd=ROOT,
                           capture_output=True, text=True)
    test_summary = (tests.stdout.strip().splitlines() or ["no output"])[-1]
    print(f"make test-gpu: {test_summary}", flush=True)
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        rc = drive_matrix(args)
    print(buffer.getvalue(), end="")
    lines, records = getattr(args, "matrix_out", ([], []))
    header = HEADER.replace("| ", f"| {'model, mode, activation checkpointing: ':<36}", 1)
    checks = []
    for model, (ratio, mfu) in TARGETS.items():
        for r in records:
            if r.get("model") == model and r["case"].startswith("ours") and "tokens_per_s" in r:
                got_ratio, got_mfu = r.get("vs_torchtitan"), r.get("mfu")
                mode = f"{'compiled' if r['compile'] else 'eager'}, ac {r['ac']}"
                ok = got_ratio is not None and got_ratio >= ratio and got_mfu is not None and got_mfu >= mfu
                checks.append(f"- {model}, {mode}: ours / torchtitan (sdpa) {fmt(got_ratio, '.2f')} (target >= "
                              f"{ratio}), MFU {fmt(got_mfu and 100 * got_mfu, '.1f')}% (target >= {100 * mfu:.0f}%): "
                              f"{'met' if ok else 'NOT met'}")
    text = "\n".join([
        f"## GPU: ours against torchtitan, {device} ({date})",
        f"`make gpu-report` on {device}, torch {torch.__version__} (ours and torchtitan in one environment).",
        f"`make test-gpu`: {test_summary} (exit {tests.returncode}).", "",
        header, "|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|", *lines, "",
        "Targets (issue 20):", *checks, "", MEMORY_NOTE, "",
        "Remaining differences: torchtitan tokenises the shipped corpus on the fly, ours reads it pre-tokenised "
        "(`--data builtin`), the bare loop random tokens; torchtitan builds its own Llama (RoPE as complex "
        "numbers, its init); its flex rows use its per-document block-causal masks, ours plain causal.", ""])
    args.report.write_text(text)
    print(f"\nwritten: {args.report} (paste it into BENCHMARKS.md)")
    return rc or tests.returncode


if __name__ == "__main__":
    sys.exit(main())
