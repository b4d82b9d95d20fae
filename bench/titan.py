"""torchtitan's trainer as a third case beside trainer/speed.py's ours and bare, for
bench/trainer.py's comparison (the benchmark's, not a node check's: `slipway gpu-check` runs
ours and bare). One case per process, with trainer/speed.py's flags and its `RESULT {json}`:

    python bench/titan.py torchtitan [--device cuda] [--preset tiny ...] [--attention-titan flex]

torchtitan runs through its own entry point, on this torch, with the same model, batch, dtype,
compile and activation checkpointing as ours (TITAN_MODULE); its logged tps parsed. It needs
CUDA.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common.errors import failure_line  # noqa: E402
from trainer.speed import rates, flash_only, main, model_dict, steady  # noqa: E402

ASSETS = ROOT / "trainer" / "assets"

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


def titan_params(case: Any, attention: str, work: Path) -> dict[str, Any]:
    """What the torchtitan config module reads: our model's dimensions and padded vocabulary."""
    from common.schema import from_dict
    from trainer.config import ModelSection

    mcfg = from_dict(ModelSection, model_dict(case))
    return dict(dim=mcfg.hidden_size, heads=mcfg.num_heads, kv_heads=mcfg.num_kv_heads, layers=mcfg.num_layers,
                vocab=mcfg.padded_vocab_size, ffn=mcfg.intermediate_size, seq_len=case.seq_len,
                batch=case.micro_batch, steps=case.steps, dtype=case.dtype, compile=case.compile, ac=case.ac,
                log_freq=case.log_interval, attention=attention, flash_backend=flash_only(case),
                corpus=str(ASSETS / "corpus.jsonl.gz"), assets=str(work / "assets"), dump=str(work / "dump"))


def titan_env(work: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(work), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(work / "hf-datasets")}


def case_torchtitan(case: Any, attention: str = "sdpa") -> dict[str, Any]:
    """torchtitan under torchrun (one process), its logged tps over the windows from --warmup on."""
    work = Path(tempfile.mkdtemp(prefix="slipway-titan-"))
    try:
        (work / "assets").mkdir()
        shutil.copy(ASSETS / "tokenizer.json", work / "assets" / "tokenizer.json")
        (work / "slipway_titan.py").write_text(TITAN_MODULE.format(params=titan_params(case, attention,
                                                                                       work)))
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                "-m", "torchtitan.train", "--module", "slipway_titan", "--config", "slipway_llama"]
        env = titan_env(work)
        if case.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True)
        output = proc.stdout + proc.stderr
        rows = [m for m in map(TPS_LINE.search, re.sub(r"\x1b\[[0-9;]*m", "", output).splitlines()) if m]
        if proc.returncode != 0 or not rows:
            reason = titan_error(output)
            if "_cuda_setDevice" in reason or "Torch not compiled with CUDA" in reason:
                reason = ("torchtitan needs CUDA: without an accelerator it still picks device 'cuda' "
                          f"(torchtitan/tools/utils.py) and fails in Trainer.__init__ ({reason})")
            raise RuntimeError(reason)
        records = []
        for m in rows:  # its memory is what it reserved, not what it allocated
            tps = float(m[3].replace(",", ""))
            records.append({"step": int(m[1]), "tokens_per_s": tps, "step_time_s": case.micro_batch * case.seq_len / tps,
                            "peak_memory_gib": float(m[2])})
        out = steady(records, case.warmup)
        return rates(case, {**out, "peak_memory_gib": None, "peak_reserved_gib": out["peak_memory_gib"]})
    finally:
        shutil.rmtree(work, ignore_errors=True)


def titan_error(output: str) -> str:
    """The root cause in a torchrun failure: the child's last exception line, not torchrun's."""
    lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", output).splitlines()]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b", ln) and "ChildFailedError" not in ln]
    return (errors[-1] if errors else failure_line(output))[:300]



if __name__ == "__main__":
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--attention-titan", choices=("sdpa", "flex"), default="sdpa")
    known, rest = pre.parse_known_args()
    sys.exit(main(rest, cases={"torchtitan": lambda case: case_torchtitan(case, known.attention_titan)},
                  prog="bench/titan.py"))
