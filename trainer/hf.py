"""Hugging Face Llama interop: initialise from an HF checkpoint, export to one.

Names map one to one (torchtitan's `state_dict_adapter` pattern: `_TOP_LEVEL` and `_IN_LAYER`
below; HF's `lm_head.weight` is absent when tied). Our rotary embeddings use HF's rotate_half
layout (trainer/model.py), so q/k weights need no permutation; the tests compare logits with
transformers. Padded vocabulary rows (model.pad_vocab_multiple) are zeros on import, cut on export.

Command line (one-line errors, exit status 2 on bad input):

    python -m trainer.hf export --run RUN_DIR [--step N] --out DIR [--dtype bfloat16]
    python -m trainer.hf inspect HF_DIR      # prints a `model:` section for a config
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch import nn

from common.edge import Parser, run_at_edge
from common.errors import ConfigError
from common.rundir import BAD_INPUT_EXIT
from trainer.checkpoint import MODEL_KEY, quiet_single_process
from trainer.config import ModelSection

WHERE = "model.init_from_hf"
INDEX = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_SHARD_BYTES = 5 * 2**30  # what transformers' save_pretrained uses

_TOP_LEVEL = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "output.weight"}
_IN_LAYER = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
             "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
             "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
             "mlp.down_proj": "feed_forward.w2", "input_layernorm": "attention_norm",
             "post_attention_layernorm": "ffn_norm"}
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")
_OUR_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)\.weight")
# HF config.json key -> ModelSection field, compared before any weight is read.
_MATCHED = (("hidden_size", "hidden_size"), ("intermediate_size", "intermediate_size"),
            ("num_hidden_layers", "num_layers"), ("num_attention_heads", "num_heads"),
            ("num_key_value_heads", "num_kv_heads"), ("vocab_size", "vocab_size"),
            ("rope_theta", "rope_theta"), ("rms_norm_eps", "rms_norm_eps"),
            ("tie_word_embeddings", "tie_embeddings"))


# ---------------------------------------------------------------- names


def read_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) model tensors of complete checkpoint `path`, on the CPU, read by this
    one process without a process group; the optimizer's entries are not read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    prefix = f"{MODEL_KEY}."
    full = {name: torch.empty(md.size, dtype=md.properties.dtype)
            for name, md in metadata.state_dict_metadata.items()
            if name.startswith(prefix) and isinstance(md, TensorStorageMetadata)}
    if not full:
        raise ValueError(f"{path} holds no {prefix}* tensors; it has "
                         f"{', '.join(sorted(metadata.state_dict_metadata)[:5])} ...")
    quiet_single_process()
    dcp.load(full, checkpoint_id=path, no_dist=True)
    return {name.removeprefix(prefix): value for name, value in full.items()}


def hf_to_ours(name: str) -> Optional[str]:
    """Our name for an HF tensor name; None for what we do not keep (rotary caches)."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    if (match := _HF_LAYER_RE.fullmatch(name)) and match.group(2) in _IN_LAYER:
        return f"layers.{match.group(1)}.{_IN_LAYER[match.group(2)]}.weight"
    if name.endswith("rotary_emb.inv_freq"):  # recomputed, stored by old transformers versions
        return None
    raise ConfigError(WHERE, f"unexpected tensor {name!r} in the HF checkpoint: not a Llama weight "
                             "(biases, other architectures and quantised weights are not supported)")


def ours_to_hf(name: str) -> str:
    top = {ours: hf for hf, ours in _TOP_LEVEL.items()}
    in_layer = {ours: hf for hf, ours in _IN_LAYER.items()}
    if name in top:
        return top[name]
    if (match := _OUR_LAYER_RE.fullmatch(name)) and match.group(2) in in_layer:
        return f"model.layers.{match.group(1)}.{in_layer[match.group(2)]}.weight"
    raise ValueError(f"{name!r} is not a weight of trainer.model.Transformer")


def expected_shapes(cfg: ModelSection) -> dict[str, tuple[int, ...]]:
    """Every weight of the full model (output.weight only when untied), by our names."""
    h, i, v, kv = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (v, h), "norm.weight": (h,)}
    if not cfg.tie_embeddings:
        shapes["output.weight"] = (v, h)
    per_layer = {"attention_norm": (h,), "attention.wq": (h, h), "attention.wk": (kv, h),
                 "attention.wv": (kv, h), "attention.wo": (h, h), "ffn_norm": (h,),
                 "feed_forward.w1": (i, h), "feed_forward.w3": (i, h), "feed_forward.w2": (h, i)}
    shapes.update((f"layers.{layer}.{name}.weight", shape) for layer in range(cfg.num_layers)
                  for name, shape in per_layer.items())
    return shapes


def _check_complete(weights: dict[str, torch.Tensor], cfg: ModelSection, source: str) -> None:
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        what = (f"missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}" if missing
                else f"has extra {', '.join(extra[:4])}")
        raise ConfigError(WHERE, f"{source} {what} for a model with num_layers {cfg.num_layers}, "
                                 f"tie_embeddings {cfg.tie_embeddings}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ConfigError(WHERE, f"{source}: {name} has shape {tuple(weights[name].shape)}, the model "
                                     f"section implies {shape}")


def _resize_vocab(weights: dict[str, torch.Tensor], rows: int) -> None:
    """The embedding and the output cut or zero-padded to `rows`, whatever padding they were saved with
    (no token id reaches the padding, and the model cuts its logits off)."""
    for name in ("tok_embeddings.weight", "output.weight"):
        w = weights.get(name)
        if w is not None and w.shape[0] > rows:
            weights[name] = w[:rows]
        elif w is not None and w.shape[0] < rows:
            weights[name] = torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


# ---------------------------------------------------------------- config.json


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    """config.json of a local Llama checkpoint, with transformers' defaults filled in."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ConfigError(WHERE, f"{hf_dir} is not a local directory: download the model first "
                                 f"(huggingface-cli download NAME --local-dir DIR) and point at DIR")
    path = hf_dir / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(WHERE, f"{hf_dir} has no config.json: point at a Hugging Face model directory "
                                 "(config.json and *.safetensors)") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(WHERE, f"{path} is not valid JSON: {exc}") from None
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in required if not isinstance(raw.get(k), int)]
    if missing:
        raise ConfigError(WHERE, f"{path} lacks integer {', '.join(missing)}: not a Llama config.json")
    if raw.get("model_type") != "llama":
        raise ConfigError(WHERE, f"{path}: model_type is {raw.get('model_type')!r}, only 'llama' "
                                 "(LlamaForCausalLM) checkpoints map onto this model")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(WHERE, f"{path}: rope scaling {rope_type!r} is not implemented here; only plain "
                                 "rotary embeddings (rope_type default) are")
    for key, allowed in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if raw.get(key, allowed) != allowed:
            raise ConfigError(WHERE, f"{path}: {key} is {raw[key]!r}; this model needs {allowed!r}")
    cfg = {**raw, "num_key_value_heads": raw.get("num_key_value_heads") or raw["num_attention_heads"],
           "rope_theta": float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
           "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
           "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
           "max_position_embeddings": raw.get("max_position_embeddings", 2048)}
    head_dim = raw.get("head_dim")
    if head_dim is not None and head_dim != raw["hidden_size"] // raw["num_attention_heads"]:
        raise ConfigError(WHERE, f"{path}: head_dim {head_dim} != hidden_size / num_attention_heads; "
                                 "this model derives the head size from hidden_size")
    return cfg


def model_section_from_hf(hf_dir: Path) -> dict[str, Any]:
    """The `model:` section that matches an HF checkpoint (for a run config)."""
    hf = read_hf_config(hf_dir)
    return {"size": "custom", **{ours: hf[hf_key] for hf_key, ours in _MATCHED},
            "max_position_embeddings": hf["max_position_embeddings"], "init_from_hf": str(hf_dir)}


def check_matches(hf_dir: Path, cfg: ModelSection) -> None:
    """Raise ConfigError naming the first dimension where config.json and `cfg` differ."""
    hf = read_hf_config(hf_dir)
    for hf_key, ours in _MATCHED:
        theirs, mine = hf[hf_key], getattr(cfg, ours)
        same = math.isclose(theirs, mine, rel_tol=1e-9) if isinstance(mine, float) else theirs == mine
        if not same:
            raise ConfigError(WHERE, f"{hf_dir}: {hf_key} {theirs} in config.json != model.{ours} {mine}; "
                                     f"set model.{ours}: {theirs} (`python -m trainer.hf inspect {hf_dir}` "
                                     "prints the whole section)")


def hf_config_dict(cfg: ModelSection, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for LlamaForCausalLM (read by transformers 4.x and 5.x alike)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        **{hf_key: getattr(cfg, ours) for hf_key, ours in _MATCHED}, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings, "rope_scaling": None,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "initializer_range": cfg.init_std, "pretraining_tp": 1, "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


# ---------------------------------------------------------------- loading an HF checkpoint into our model


def _safetensors_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / INDEX
    if index.is_file():
        files = [hf_dir / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    elif (hf_dir / "model.safetensors").is_file():
        files = [hf_dir / "model.safetensors"]
    else:
        files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        bins = "; it has only PyTorch .bin files: re-save it with save_pretrained(safe_serialization=True)" \
            if any(hf_dir.glob("*.bin")) else ""
        raise ConfigError(WHERE, f"{hf_dir} holds no *.safetensors weights{bins}")
    for f in files:
        if not f.is_file():
            raise ConfigError(WHERE, f"{hf_dir / INDEX} names {f.name}, which is missing")
    return files


def read_hf_weights(hf_dir: Path, cfg: ModelSection) -> dict[str, torch.Tensor]:
    """Every weight of a local HF Llama checkpoint, by our names, on the CPU."""
    from safetensors import safe_open

    hf_dir = Path(hf_dir)
    check_matches(hf_dir, cfg)
    weights: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(hf_dir):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                ours = hf_to_ours(hf_name)
                if ours is not None and not (ours == "output.weight" and cfg.tie_embeddings):
                    weights[ours] = f.get_tensor(hf_name)
    _check_complete(weights, cfg, str(hf_dir))
    return weights


def load_hf_into(model: nn.Module, hf_dir: Path, cfg: ModelSection) -> None:
    """Copy an HF Llama checkpoint into materialised `model` in place (cast to its dtypes): a pipeline
    stage takes the names it has; sharded (FSDP2/TP DTensors), every rank calls this and keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if any(p.is_meta for p in model.parameters()):
        raise ValueError("load_hf_into needs a materialised model: call model.to_empty(device=...) first")
    weights = read_hf_weights(hf_dir, cfg)
    _resize_vocab(weights, cfg.padded_vocab_size)
    if cfg.tie_embeddings:
        weights["output.weight"] = weights["tok_embeddings.weight"]
    wanted = model.state_dict()  # persistent entries only; a pipeline stage holds some
    unknown = sorted(set(wanted) - set(weights))
    if unknown:
        raise ConfigError(WHERE, f"the model has {', '.join(unknown[:4])}, which an HF Llama checkpoint "
                                 "does not provide")
    subset = {name: weights[name].to(wanted[name].dtype) for name in wanted}
    set_model_state_dict(model, subset, options=StateDictOptions(full_state_dict=True, strict=True))


# ---------------------------------------------------------------- exporting to an HF checkpoint


def export_hf(source: Path, out_dir: Path, cfg: ModelSection, *, dtype: torch.dtype | None = None,
              overwrite: bool = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write `out_dir` as an HF LlamaForCausalLM checkpoint (config.json + safetensors) from a complete
    checkpoint step directory; it appears whole (written beside it, then renamed) or not at all."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists: pick another --out or pass --overwrite")
    weights = read_model_weights(Path(source))
    if cfg.tie_embeddings:
        weights.pop("output.weight", None)
    _resize_vocab(weights, cfg.vocab_size)
    _check_complete(weights, cfg, str(source))
    dtype = dtype or weights["tok_embeddings.weight"].dtype
    hf = {ours_to_hf(name): weights[name].to("cpu", dtype).contiguous() for name in expected_shapes(cfg)}

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_safetensors(tmp, hf, max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(hf_config_dict(cfg, dtype), indent=2) + "\n")
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")  # the one being replaced, out of the way
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _write_safetensors(out: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> None:
    from safetensors.torch import save_file

    shards = list(_shards(tensors, max_shard_bytes))
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = t
        size += nbytes
    yield shard


# ---------------------------------------------------------------- command line


def _export_run(run_dir: Path, step: Optional[int], out: Path, dtype: Optional[str], overwrite: bool) -> str:
    from common.rundir import complete_checkpoints
    from trainer.checkpoint import step_dir
    from trainer.config import load_trainer_config

    cfg = load_trainer_config(run_dir / "config.yaml")
    ckpt_dir = run_dir / cfg.checkpoint.dir
    steps = complete_checkpoints(ckpt_dir)
    if not steps:
        raise ConfigError("", f"{ckpt_dir} holds no complete checkpoint: train (or wait for a save) first")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ConfigError("", f"no complete checkpoint for step {step} in {ckpt_dir}; complete steps: "
                              f"{', '.join(map(str, steps))}")
    export_hf(step_dir(ckpt_dir, step), out, cfg.model, dtype=DTYPES[dtype] if dtype else None,
              overwrite=overwrite)
    return f"wrote {out} from {step_dir(ckpt_dir, step)}"


def main(argv: Optional[list[str]] = None) -> int:
    parser = Parser(prog="python -m trainer.hf", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="write a run's checkpoint as an HF Llama directory")
    exp.add_argument("--run", type=Path, required=True, help="the run directory (holds config.yaml)")
    exp.add_argument("--step", type=int, help="checkpoint step (default: the latest complete one)")
    exp.add_argument("--out", type=Path, required=True, help="output directory (must not exist)")
    exp.add_argument("--dtype", choices=sorted(DTYPES), help="cast weights (default: as saved)")
    exp.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    ins = sub.add_parser("inspect", help="print the model section matching an HF Llama directory")
    ins.add_argument("hf_dir", type=Path)
    args = parser.parse_args(argv)

    def work() -> int:
        if args.command == "export":
            print(_export_run(args.run, args.step, args.out, args.dtype, args.overwrite))
        else:
            print(yaml.safe_dump({"model": model_section_from_hf(args.hf_dir)}, sort_keys=False), end="")
        return 0

    return run_at_edge(work, prog="", errors={ValueError: BAD_INPUT_EXIT, FileExistsError: BAD_INPUT_EXIT})


if __name__ == "__main__":
    sys.exit(main())
