"""Training throughput: our trainer against a bare PyTorch loop and torchtitan.

One run prints, side by side, steady-state tokens/s, model TFLOP/s, MFU (null
on CPU or an unknown GPU) and peak memory for:

  ours          `trainer.train.train` in one process (what `python -m trainer` runs)
  ours fsdp x2  the same under `torchrun --nproc-per-node 2`, dp=2 (FSDP2); opt-in
  bare          a plain loop on the same `trainer.model.Transformer`: same batch,
                AdamW (fused on CUDA, foreach on CPU), grad clipping, same dtype
  torchtitan    torchtitan 0.3.0 from PyPI in its own venv (.cache/bench-venv),
                its llama3 trainer with the same dimensions, batch and sequence
                length, its logged tps parsed; "not run: <reason>" when it cannot

The overhead ratio is ours / bare tokens/s (1.00 = no overhead). FLOPs per
token follow torchtitan's convention (`trainer.model.num_flops_per_token`).
Every case runs in a fresh process (peak memory is per case), the first
`--warmup` steps are left out. Data is synthetic random tokens unless
`--data builtin` (the shipped corpus and tokenizer; ours only).

    .venv/bin/python bench/trainer.py                       # CPU: a small model
    .venv/bin/python bench/trainer.py --device cuda         # tiny (109M) at seq 512, bf16
    .venv/bin/python bench/trainer.py --fsdp2 --no-torchtitan
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

# Case defaults per device (a preset name or explicit dimensions).
CPU_DEFAULTS = dict(preset="custom", hidden=256, layers=4, heads=4, kv_heads=4, vocab=4096, ffn=None,
                    seq_len=256, micro_batch=8, steps=12, warmup=3, dtype="float32")
CUDA_DEFAULTS = dict(preset="tiny", seq_len=512, micro_batch=16, steps=60, warmup=10, dtype="bfloat16")


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
    base.setdefault("tie_embeddings", False)
    base["size"] = "custom"
    base["init_std"] = 0.02
    return base


def trainer_config(args: argparse.Namespace, dp: int) -> dict[str, Any]:
    return {
        "run": {"name": "bench", "seed": 0},
        "model": model_dict(args),
        "parallel": {"dp": dp, "tp": 1, "pp": 1, "dp_mode": "fsdp", "zero_stage": 1},
        "data": {"dataset": "builtin", "tokenizer": "builtin", "seq_len": args.seq_len},
        "train": {"steps": args.steps, "micro_batch_size": args.micro_batch, "grad_accum_steps": 1,
                  "lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 0, "decay": "constant", "dtype": args.dtype,
                  "compile": args.compile, "eval_interval": 0},
        "checkpoint": {"interval": 10**9, "keep_last": 1},
        "logging": {"interval": 1},
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
    """Tokens/s etc. over the logged steps after `warmup` (every step is logged)."""
    kept = [r for r in records if r["step"] > warmup] or records[-1:]
    elapsed = sum(r["step_time_s"] for r in kept)
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in kept)
    return {"steps_timed": len(kept), "step_time_s": elapsed / len(kept), "tokens_per_s": tokens / elapsed,
            "peak_memory_gib": max(r["peak_memory_gib"] for r in records)}


def case_ours(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from trainer.config import from_dict, TrainerConfig
    from trainer.train import train

    world = int(os.environ.get("WORLD_SIZE", "1"))
    raw = trainer_config(args, dp=world)
    cfg = from_dict(TrainerConfig, raw)
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
        return out
    finally:
        if world == 1:
            shutil.rmtree(run_dir, ignore_errors=True)


def case_bare(args: argparse.Namespace) -> dict[str, Any]:
    """The least a training step can do on the same model: no trainer in the way."""
    import torch
    import torch.nn.functional as F

    from trainer.config import from_dict, ModelSection
    from trainer.metrics import peak_memory_gib
    from trainer.model import Transformer, select_attention

    device = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    mcfg = from_dict(ModelSection, model_dict(args))
    torch.manual_seed(0)
    model = Transformer(mcfg, select_attention(mcfg, device, dtype)).to(device)
    if args.compile:
        for layer in model.layers.values():
            layer.compile()
    extra = {"fused": True} if device.type == "cuda" else {"foreach": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01, **extra)
    data = RandomTokens(mcfg.vocab_size, args.micro_batch, args.seq_len, 1)
    autocast = dtype != torch.float32

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = []
    for _ in range(args.steps):
        inputs, targets = (t.to(device, non_blocking=True) for t in data.next_batch())
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # a step is done when its loss is known (the trainer logs every step too)
        times.append(time.perf_counter() - t0)
    kept = times[args.warmup:] or times[-1:]
    tokens = args.micro_batch * args.seq_len
    return {"steps_timed": len(kept), "step_time_s": sum(kept) / len(kept),
            "tokens_per_s": tokens * len(kept) / sum(kept), "tokens_per_s_per_device": tokens * len(kept) / sum(kept),
            "peak_memory_gib": peak_memory_gib(device), "processes": 1}


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
# its llama3 model config with our dimensions, fp32/bf16 like ours, the shipped
# corpus and tokenizer (torchtitan's own test assets are not in the wheel), no
# checkpoints, no activation checkpointing, no validation, no compile.
TITAN_MODULE = """
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import default_adamw, LRSchedulersContainer
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets import text_datasets
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.llama3 import _build_llama3_layers, _EMBEDDING_INIT, _NORM_INIT, _output_linear_init
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.model import Llama3Model
from torchtitan.trainer import Trainer

P = {params!r}

from datasets import load_dataset
text_datasets.DATASETS["slipway_builtin"] = DatasetConfig(
    path=P["corpus"], loader=lambda path: load_dataset("json", data_files=path, split="train"),
    sample_processor=lambda sample: sample["text"])


def slipway_llama():
    dim, heads, vocab = P["dim"], P["heads"], P["vocab"]
    model = Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=P["layers"], dim=dim, n_heads=heads, n_kv_heads=P["kv_heads"],
            hidden_dim=P["ffn"],
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=P["seq_len"], theta=10000.0, scaling="none"),
            attn_backend="flex"),
    )
    spec = model_registry("debugmodel")
    spec.model, spec.flavor = model, "slipway"
    return Trainer.Config(
        loss=CrossEntropyLoss.Config(global_vocab_size=vocab),
        hf_assets_path=P["assets"],
        model_spec=spec,
        optimizer=default_adamw(lr=3e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=1, decay_ratio=None),
        training=TrainingConfig(local_batch_size=P["batch"], seq_len=P["seq_len"], steps=P["steps"],
                                dtype="float32", mixed_precision_param=P["dtype"]),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="slipway_builtin"),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(),
        checkpoint=CheckpointManager.Config(enable=False),
        compile=CompileConfig(enable=P["compile"]),
        dump_folder=P["dump"],
    )
"""

TPS_LINE = re.compile(r"step:\s*(\d+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+).*?tflops:\s*([\d,.]+).*?mfu:\s*(\S+)")


def titan_python(args: argparse.Namespace) -> tuple[Optional[Path], str]:
    """The bench venv's python with torchtitan importable, or None and why not."""
    python = BENCH_VENV / "bin" / "python"
    check = [str(python), "-c", "import torchtitan, torch; print(torch.__version__)"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python, ""
    if args.no_install:
        return None, f"not installed in {BENCH_VENV.relative_to(ROOT)} (--no-install)"
    print(f"installing torchtitan {TORCHTITAN_VERSION} into {BENCH_VENV.relative_to(ROOT)} ...", file=sys.stderr)
    steps = [[sys.executable if shutil.which("python3") is None else "python3", "-m", "venv", str(BENCH_VENV)],
             [str(python), "-m", "pip", "install", "-q", "torch==2.13.0", f"torchtitan=={TORCHTITAN_VERSION}",
              "triton"]]  # torchtitan imports triton unconditionally; CPU torch wheels do not pull it in
    for step in steps:
        proc = subprocess.run(step, capture_output=True, text=True)
        if proc.returncode != 0:
            return None, f"install failed: {first_error(proc.stdout + proc.stderr)}"
    return python, ""


def run_torchtitan(args: argparse.Namespace) -> tuple[Optional[dict], str]:
    python, why = titan_python(args)
    if python is None:
        return None, why
    mcfg = model_dict(args)
    work = Path(tempfile.mkdtemp(prefix="slipway-bench-titan-"))
    try:
        assets = work / "assets"
        assets.mkdir()
        shutil.copy(ROOT / "trainer" / "assets" / "tokenizer.json", assets / "tokenizer.json")
        params = dict(dim=mcfg["hidden_size"], heads=mcfg["num_heads"], kv_heads=mcfg["num_kv_heads"],
                      layers=mcfg["num_layers"], vocab=mcfg["vocab_size"], ffn=mcfg["intermediate_size"],
                      seq_len=args.seq_len, batch=args.micro_batch, steps=args.steps, dtype=args.dtype,
                      compile=args.compile, corpus=str(ROOT / "trainer" / "assets" / "corpus.jsonl.gz"),
                      assets=str(assets), dump=str(work / "dump"))
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
        kept = [r for r in rows if r["step"] > args.warmup] or rows[-1:]
        # tps per logged step (log_freq 1); the steady figure is tokens over time, not a mean of rates.
        tokens = args.micro_batch * args.seq_len
        tps = len(kept) * tokens / sum(tokens / r["tps"] for r in kept)
        mfu = None if kept[-1]["mfu"] in ("N/A", "n/a") else float(kept[-1]["mfu"].rstrip("%")) / 100
        version = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True,
                                 text=True).stdout.strip()
        return {"steps_timed": len(kept), "tokens_per_s": tps, "tokens_per_s_per_device": tps,
                "peak_memory_gib": max(r["mem"] for r in rows), "processes": 1, "titan_mfu": mfu,
                "torch": version, "memory_kind": "torchtitan max_reserved"}, output
    finally:
        if not os.environ.get("SLIPWAY_BENCH_KEEP"):
            shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------
# The driver: start each case, collect, print.
# --------------------------------------------------------------------------


def case_argv(args: argparse.Namespace, case: str) -> list[str]:
    argv = [str(Path(__file__).resolve()), "--case", case, "--device", args.device, "--preset", args.preset,
            "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--dtype", args.dtype, "--data", args.data]
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
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="CPU default float32, CUDA bfloat16")
    parser.add_argument("--data", choices=("synthetic", "builtin"), default="synthetic",
                        help="ours only: random tokens, or the shipped corpus and tokenizer")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block (ours and bare)")
    parser.add_argument("--fsdp2", action="store_true", help="also run ours on 2 processes, dp=2 (FSDP2)")
    parser.add_argument("--no-torchtitan", action="store_true", help="skip torchtitan")
    parser.add_argument("--no-install", action="store_true",
                        help="use .cache/bench-venv only if it exists; never pip install")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for every case (CPU: torchrun's default "
                        "is 1 per process; a busy machine gives steadier figures at 1)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per case")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--case", choices=("ours", "bare"), help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.device is None:
        try:
            import torch
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            args.device = "cpu"
    defaults = CUDA_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    if args.preset is not None and args.preset != "custom" and args.device == "cpu":
        defaults = {**defaults, "hidden": None, "layers": None, "heads": None, "kv_heads": None, "vocab": None}
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.case:
        return run_case_here(args)
    return drive(args)


def fmt(value: Any, spec: str) -> str:
    return "null" if value is None else format(value, spec)


def drive(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT))
    import torch

    from trainer.config import from_dict, ModelSection
    from trainer.metrics import peak_flops
    from trainer.model import num_flops_per_token

    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by every case's process
    mcfg = from_dict(ModelSection, model_dict(args))
    flops_per_token = num_flops_per_token(mcfg, args.seq_len)
    peak = peak_flops(torch.device(args.device)) if args.device == "cuda" else None
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({os.cpu_count()} cores)"
    print(f"model: hidden {mcfg.hidden_size}, ffn {mcfg.intermediate_size}, {mcfg.num_layers} layers, "
          f"{mcfg.num_heads} heads ({mcfg.num_kv_heads} kv), vocab {mcfg.vocab_size}, "
          f"tied {mcfg.tie_embeddings}, {mcfg.num_params() / 1e6:.1f}M params; micro batch {args.micro_batch} x "
          f"seq {args.seq_len}, {args.dtype}, {args.steps} steps ({args.warmup} warmup left out), data {args.data}; "
          f"{device_name}, OMP_NUM_THREADS {os.environ.get('OMP_NUM_THREADS', 'unset')}; torch {torch.__version__}; {flops_per_token / 1e6:.1f} MFLOP/token", flush=True)

    cases: list[tuple[str, Optional[dict], str]] = []

    def add(name: str, result: Optional[dict], output: str) -> None:
        cases.append((name, result, output))
        if result is None:
            reason = first_error(output) if "\n" in output else output
            print(f"  {name}: not run: {reason}", file=sys.stderr, flush=True)
        else:
            print(f"  {name}: {result['tokens_per_s']:,.0f} tok/s", file=sys.stderr, flush=True)

    add("ours (1 process)", *run_subprocess([sys.executable, *case_argv(args, "ours")], args.timeout))
    if args.fsdp2:
        add("ours (2 processes, fsdp dp=2)", *run_ours_fsdp2(args))
    add("bare PyTorch loop", *run_subprocess([sys.executable, *case_argv(args, "bare")], args.timeout))
    if args.no_torchtitan:
        add(f"torchtitan {TORCHTITAN_VERSION}", None, "not run: --no-torchtitan")
    else:
        add(f"torchtitan {TORCHTITAN_VERSION}", *run_torchtitan(args))

    ours = cases[0][1]
    bare = next(r for n, r, _ in cases if n.startswith("bare"))
    header = (f"| {'case':<32} | {'tokens/s':>10} | {'tok/s/dev':>10} | {'TFLOP/s/dev':>11} | {'MFU':>6} | "
              f"{'peak mem GiB':>12} | {'vs bare':>7} |")
    print()
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    table = []
    for name, r, output in cases:
        if r is None:
            reason = output if "\n" not in output else first_error(output)
            reason = reason if reason.startswith("not run") else f"not run: {reason}"
            print(f"| {name:<32} | {reason} |")
            table.append({"case": name, "not_run": reason})
            continue
        per_dev = r["tokens_per_s_per_device"]
        tflops = flops_per_token * per_dev / 1e12
        mfu = tflops * 1e12 / peak if peak else None
        ratio = per_dev / bare["tokens_per_s"] if bare else None
        print(f"| {name:<32} | {r['tokens_per_s']:>10,.0f} | {per_dev:>10,.0f} | {tflops:>11.4f} | "
              f"{fmt(mfu and 100 * mfu, '5.1f'):>6} | {r['peak_memory_gib']:>12.2f} | {fmt(ratio, '.2f'):>7} |")
        table.append({"case": name, **r, "tflops_per_device": tflops, "mfu": mfu, "vs_bare": ratio})
    if ours and bare:
        print(f"\ntrainer overhead: ours / bare = {ours['tokens_per_s'] / bare['tokens_per_s']:.3f} "
              f"(step {1e3 * ours['step_time_s']:.1f} ms vs {1e3 * bare['step_time_s']:.1f} ms)")
    print("peak memory: CUDA max allocated (torchtitan: max reserved); on CPU the process's max RSS.")
    if args.json:
        args.json.write_text(json.dumps({"flops_per_token": flops_per_token, "cases": table}, indent=1))
    return 0 if ours else 1


if __name__ == "__main__":
    sys.exit(main())
