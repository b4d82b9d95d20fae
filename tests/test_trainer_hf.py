"""Hugging Face Llama interop: same logits as transformers after loading and after exporting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from trainer.checkpoint import Checkpointer
from trainer.states import ModelState
from common.errors import ConfigError
from common.schema import from_dict
from trainer.config import CheckpointSection, ModelSection
from trainer.hf import export_hf, load_hf_into, main, model_section_from_hf
from trainer.model import Transformer

transformers = pytest.importorskip("transformers", reason="the HF interop tests compare against transformers")

ROOT = Path(__file__).resolve().parent.parent
DIMS = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
            max_position_embeddings=32, rope_theta=1234.0, rms_norm_eps=1e-6)


def make_hf(path: Path, tie: bool, kv_heads: int = 2, vocab_size: int = DIMS["vocab_size"],
            **save_kw) -> "transformers.LlamaForCausalLM":
    """A tiny random Llama saved with save_pretrained; every weight (norms too) randomised,
    so a swapped or mis-permuted tensor shows in the logits."""
    config = transformers.LlamaConfig(**{**DIMS, "vocab_size": vocab_size}, num_key_value_heads=kv_heads,
                                      tie_word_embeddings=tie, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    model.save_pretrained(path, **save_kw)
    return model


def section(path: Path) -> ModelSection:
    return from_dict(ModelSection, model_section_from_hf(path), "model")


def tokens(vocab_size: int = DIMS["vocab_size"]) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens(model.config.vocab_size)).logits


def our_logits(model: Transformer) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(tokens(model.cfg.vocab_size))


def checkpoint_of(model: Transformer, ckpt_dir: Path) -> Path:
    """`model` saved as the training loop saves it: the step directory an export reads."""
    Checkpointer(ckpt_dir, CheckpointSection()).save(1, {"model": ModelState(model)})
    return ckpt_dir / "step-000001"


def load_ours(path: Path) -> Transformer:
    cfg = section(path)
    model = Transformer(cfg)
    load_hf_into(model, path, cfg)
    return model


@pytest.mark.parametrize("tie,kv_heads", [(True, 2), (False, 2), (False, 4)],
                         ids=["tied-gqa", "untied-gqa", "untied-mha"])
@pytest.mark.slow
def test_load_and_export_give_transformers_logits(tmp_path, tie, kv_heads):
    hf = make_hf(tmp_path / "hf", tie, kv_heads)
    ours = load_ours(tmp_path / "hf")
    expected = hf_logits(hf)
    torch.testing.assert_close(our_logits(ours), expected, atol=1e-5, rtol=1e-5)
    assert (ours.output.weight is ours.tok_embeddings.weight) == tie

    export_hf(checkpoint_of(ours, tmp_path / "ck"), tmp_path / "out", ours.cfg)
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert back.config.tie_word_embeddings == tie and back.config.num_key_value_heads == kv_heads
    torch.testing.assert_close(hf_logits(back), expected, atol=1e-5, rtol=1e-5)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLM"] and saved["rope_theta"] == 1234.0


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_padded_vocabulary_round_trips_exactly(tmp_path, tie):
    """vocab 61 -> 64 rows here (model.pad_vocab_multiple 64): the import fills the padded rows,
    the logits are the 61 real ones, and the export writes 61 rows, bit for bit."""
    from safetensors.torch import load_file

    hf = make_hf(tmp_path / "hf", tie, vocab_size=61)
    ours = load_ours(tmp_path / "hf")
    assert ours.tok_embeddings.weight.shape[0] == ours.cfg.padded_vocab_size == 64
    assert (ours.tok_embeddings.weight[61:] == 0).all()
    torch.testing.assert_close(our_logits(ours), hf_logits(hf), atol=1e-5, rtol=1e-5)

    export_hf(checkpoint_of(ours, tmp_path / "ck"), tmp_path / "out", ours.cfg)
    saved, original = load_file(tmp_path / "out" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == 61
    for name in ("model.embed_tokens.weight",) + (() if tie else ("lm_head.weight",)):
        assert saved[name].shape == (61, DIMS["hidden_size"])
        assert torch.equal(saved[name], original[name]), name
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    torch.testing.assert_close(hf_logits(back), hf_logits(hf), atol=0, rtol=0)


def test_sharded_checkpoints_both_ways(tmp_path):
    hf = make_hf(tmp_path / "hf", tie=False, max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ours = load_ours(tmp_path / "hf")
    export_hf(checkpoint_of(ours, tmp_path / "ck"), tmp_path / "out", ours.cfg, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    back = load_ours(tmp_path / "out")
    torch.testing.assert_close(our_logits(back), hf_logits(hf), atol=1e-5, rtol=1e-5)


def test_cli_exports_a_runs_checkpoint(tmp_path, capsys):
    hf = make_hf(tmp_path / "hf", tie=True)
    ours = load_ours(tmp_path / "hf")
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    run_cfg = {"run": {"name": "r1"}, "model": model_section_from_hf(tmp_path / "hf"), "data": {"seq_len": 16},
               "slurm": {"nodes": 1}}  # host sections are the host's business: skipped
    (run / "config.yaml").write_text(yaml.safe_dump(run_cfg))
    ck = Checkpointer(run / "checkpoints", CheckpointSection())
    ck.save(7, {"model": ModelState(ours), "train": {"step": 7}})

    assert main(["export", "--run", str(run), "--out", str(tmp_path / "exp"), "--dtype", "bfloat16"]) == 0
    assert "step-000007" in capsys.readouterr().out
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "exp", attn_implementation="eager")
    assert back.dtype == torch.bfloat16
    capsys.readouterr()  # transformers' progress bars
    torch.testing.assert_close(hf_logits(back.float().eval()), hf_logits(hf), atol=0.1, rtol=0.05)

    assert main(["export", "--run", str(run), "--out", str(tmp_path / "exp")]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and len(err.strip().splitlines()) == 1
    assert main(["export", "--run", str(run), "--step", "3", "--out", str(tmp_path / "x")]) == 2
    assert "complete steps: 7" in capsys.readouterr().err
    assert main(["export", "--run", str(run), "--step", "7", "--out", str(tmp_path / "exp"), "--overwrite"]) == 0
    assert not list(tmp_path.glob(".exp*"))  # no temporary directories left behind


@pytest.mark.slow
def test_inspect_prints_a_model_section(tmp_path):
    make_hf(tmp_path / "hf", tie=False)
    out = subprocess.run([sys.executable, "-m", "trainer.hf", "inspect", str(tmp_path / "hf")], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    model = yaml.safe_load(out)["model"]
    assert model["hidden_size"] == 32 and model["num_layers"] == 2 and model["num_kv_heads"] == 2
    assert model["tie_embeddings"] is False and model["rope_theta"] == 1234.0
    from_dict(ModelSection, model, "model")  # a valid section as printed
    bad = subprocess.run([sys.executable, "-m", "trainer.hf", "inspect", str(tmp_path / "nope")], cwd=ROOT,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "is not a local directory" in bad.stderr


def test_mismatches_are_config_errors(tmp_path):
    make_hf(tmp_path / "hf", tie=True)
    good = model_section_from_hf(tmp_path / "hf")
    for key, value, hf_key in (("hidden_size", 64, "hidden_size"), ("num_kv_heads", 4, "num_key_value_heads"),
                               ("tie_embeddings", False, "tie_word_embeddings"), ("rope_theta", 10000.0, "rope_theta")):
        cfg = from_dict(ModelSection, {**good, key: value}, "model")
        with pytest.raises(ConfigError, match=rf"^model\.init_from_hf: .*{hf_key} .* in config\.json != "
                                              rf"model\.{key} {value}; set model\.{key}: "):
            load_hf_into(Transformer(cfg), tmp_path / "hf", cfg)

    cfg = section(tmp_path / "hf")
    with pytest.raises(ConfigError, match="no config.json"):
        load_hf_into(Transformer(cfg), tmp_path, cfg)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    with pytest.raises(ConfigError, match="model_type is 'qwen2'"):
        load_hf_into(Transformer(cfg), tmp_path / "hf", cfg)
    with pytest.raises(FileExistsError):
        export_hf(checkpoint_of(Transformer(cfg), tmp_path / "ck"), tmp_path / "hf", cfg)
