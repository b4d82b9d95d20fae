"""Single-process unit tests: the Llama decoder, its initialisation, the
optimizer pieces, the mesh arithmetic and the image smoke test."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F

from common.errors import ConfigError
from trainer.config import ModelSection, ParallelSection, TrainSection
from common.layouts import num_flops_per_token
from trainer.model import Transformer, seeded_normal, select_attention
from trainer.optim import Schedule, build_optimizer, clip_grad_norm_, lr_at, param_groups
from trainer.parallel import ParallelDims, split_for_stage, stage_layers

from trainer_helpers import TINY_MODEL


def model_cfg(**overrides) -> ModelSection:
    cfg = ModelSection(**{**TINY_MODEL, **overrides})
    cfg.check("model")
    return cfg


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer(model_cfg())


# ---- the model --------------------------------------------------------------


def test_module_names_are_the_checkpoint_contract(model):
    names = set(dict(model.named_parameters()))
    layer = {f"layers.0.{n}.weight" for n in ("attention_norm", "attention.wq", "attention.wk", "attention.wv",
                                               "attention.wo", "ffn_norm", "feed_forward.w1", "feed_forward.w2",
                                               "feed_forward.w3")}
    assert layer | {"tok_embeddings.weight", "norm.weight", "output.weight"} <= names
    assert not [n for n in names if n.endswith("bias")]
    assert list(model.layers.keys()) == ["0", "1", "2", "3"]
    assert not [n for n in model.state_dict() if "rope" in n]  # buffers are not checkpointed


def test_logits_shape(model):
    tokens_BT = torch.randint(0, 256, (3, 17))
    assert model(tokens_BT).shape == (3, 17, 256)


@pytest.mark.parametrize("tied", [False, True])
def test_param_count_matches_config(tied):
    cfg = model_cfg(tie_embeddings=tied)
    m = Transformer(cfg)
    assert sum(p.numel() for p in m.parameters()) == cfg.num_params()
    assert (m.output.weight is m.tok_embeddings.weight) == tied


def test_gqa_shapes(model):
    attn = model.layers["0"].attention
    assert attn.wq.weight.shape == (64, 64)
    assert attn.wk.weight.shape == attn.wv.weight.shape == (2 * 16, 64)  # 2 kv heads of 16


def test_attention_matches_reference_gqa(model):
    """SDPA with enable_gqa equals explicit causal softmax attention with kv heads repeated."""
    attn = model.layers["1"].attention
    x_BTD = torch.randn(2, 9, 64)
    cos, sin = model.rope_cos, model.rope_sin
    from trainer.model import apply_rope

    q = apply_rope(attn.wq(x_BTD).view(2, 9, 4, 16), cos[:9], sin[:9]).transpose(1, 2)
    k = apply_rope(attn.wk(x_BTD).view(2, 9, 2, 16), cos[:9], sin[:9]).transpose(1, 2)
    v = attn.wv(x_BTD).view(2, 9, 2, 16).transpose(1, 2)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = q @ k.transpose(-1, -2) / 4.0
    scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    expected = attn.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 9, 64))
    torch.testing.assert_close(attn(x_BTD, cos, sin), expected, rtol=1e-5, atol=1e-5)


def test_causal_masking(model):
    tokens_BT = torch.randint(0, 256, (1, 12))
    changed = tokens_BT.clone()
    changed[0, 7] = (changed[0, 7] + 1) % 256
    a, b = model(tokens_BT), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_matches_hugging_face_llama():
    """Same weights, same logits as transformers' LlamaForCausalLM: the rotary layout
    is HF's rotate_half, so HF q_proj/k_proj map onto wq/wk without permutation."""
    transformers = pytest.importorskip("transformers")
    cfg = model_cfg()
    ours = Transformer(cfg)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    names = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
             "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
             "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
             "post_attention_layernorm": "ffn_norm"}
    src = dict(ours.named_parameters())
    with torch.no_grad():
        for name, param in hf.named_parameters():
            key = (name.replace("model.embed_tokens", "tok_embeddings").replace("model.norm", "norm")
                   .replace("lm_head", "output").replace("model.layers", "layers"))
            for hf_name, our_name in names.items():
                key = key.replace(hf_name, our_name)
            param.copy_(src[key])
    tokens_BT = torch.randint(0, cfg.vocab_size, (2, 20))
    torch.testing.assert_close(ours(tokens_BT), hf(tokens_BT).logits, rtol=1e-4, atol=1e-4)


def test_init_is_seeded_and_scaled():
    cfg = model_cfg(num_layers=8, init_std=0.05)
    a, b = Transformer(cfg), Transformer(cfg)
    a.init_weights(seed=3)
    b.init_weights(seed=3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    b.init_weights(seed=4)
    assert not torch.equal(a.tok_embeddings.weight, b.tok_embeddings.weight)
    assert a.layers["0"].attention_norm.weight.eq(1).all()
    assert a.layers["0"].feed_forward.w1.weight.std().item() == pytest.approx(0.05, rel=0.05)
    assert a.layers["0"].feed_forward.w2.weight.std().item() == pytest.approx(0.05 / 4, rel=0.05)  # 1/sqrt(2*8)


def test_init_shards_are_slices_of_the_full_tensor():
    """What a rank generates for its shard equals that slice of the unsharded init."""
    full = seeded_normal(5, "w", torch.Size([600, 10]), (0, 0), (600, 10), 1.0)
    shard = seeded_normal(5, "w", torch.Size([600, 10]), (250, 3), (300, 4), 1.0)
    torch.testing.assert_close(shard, full[250:550, 3:7], rtol=0, atol=0)
    assert not torch.equal(full, seeded_normal(5, "v", torch.Size([600, 10]), (0, 0), (600, 10), 1.0))


def test_num_flops_per_token():
    cfg = model_cfg()
    n_matmul = cfg.num_params() - cfg.vocab_size * cfg.hidden_size  # without the input embedding
    assert num_flops_per_token(cfg, 32) == 6 * n_matmul + 12 * 4 * 4 * 16 * 32
    tied = model_cfg(tie_embeddings=True)
    assert num_flops_per_token(tied, 32) == 6 * tied.num_params() + 12 * 4 * 4 * 16 * 32


def test_attention_choice_on_cpu():
    assert select_attention(model_cfg(), torch.device("cpu"), torch.float32) == "sdpa"
    with pytest.raises(ConfigError, match="model.attention: is flash but"):
        select_attention(model_cfg(attention="flash"), torch.device("cpu"), torch.float32)


# ---- optimizer pieces -------------------------------------------------------


def test_no_weight_decay_on_norms(model):
    groups = param_groups(model, 0.1)
    for group in groups:
        assert all((p.dim() >= 2) == (group["weight_decay"] == 0.1) for p in group["params"])
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_lr_schedule():
    cfg = TrainSection(steps=100, warmup_steps=10, lr=1.0, min_lr=0.1, decay="cosine")
    assert lr_at(1, cfg) == pytest.approx(0.1)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(55, cfg) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert lr_at(100, cfg) == pytest.approx(0.1)
    linear = TrainSection(steps=100, warmup_steps=0, lr=1.0, min_lr=0.0, decay="linear")
    assert lr_at(50, linear) == pytest.approx(0.5)
    assert lr_at(77, TrainSection(steps=100, warmup_steps=10, lr=1.0, decay="constant")) == 1.0
    # The scheduler applies lr_at(step) during optimizer step `step` and round-trips its state.
    m = torch.nn.Linear(2, 2)
    opt = build_optimizer(m, cfg)
    sched = Schedule(opt, cfg)
    seen = []
    for _ in range(60):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert seen[0] == pytest.approx(0.1) and seen[9] == pytest.approx(1.0)
    fresh = Schedule(build_optimizer(m, cfg), cfg)
    fresh.load_state_dict(sched.state_dict())
    assert fresh.get_last_lr() == sched.get_last_lr() and not fresh.said
    # Trained on (train.steps 100 -> 200 at step 60): the rate goes on from where it was, never up.
    for train_on, after in (("decay", lambda lr: lr < seen[-1]), ("constant", lambda lr: lr == pytest.approx(seen[-1]))):
        longer = TrainSection(steps=200, warmup_steps=10, lr=1.0, min_lr=0.1, decay="cosine", train_on=train_on)
        on = Schedule(build_optimizer(m, longer), longer)
        on.load_state_dict(sched.state_dict())
        lrs = [on.get_last_lr()[0]] + [(on.step(), on.get_last_lr()[0])[1] for _ in range(139)]
        assert lrs[0] == pytest.approx(seen[-1], rel=0.01) and after(lrs[70]) and "train.steps 100 -> 200" in on.said
        assert all(b <= a + 1e-12 for a, b in zip(lrs, lrs[1:])), lrs
        again = Schedule(build_optimizer(m, longer), longer)  # resumed under the same plan
        again.load_state_dict(on.state_dict())
        assert again.get_last_lr() == on.get_last_lr() and not again.said
    assert lrs[-1] == pytest.approx(seen[-1])


def test_clip_grad_norm_matches_torch():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    (a(torch.randn(4, 8)).pow(2).sum() * 100).backward()
    for pa, pb in zip(a.parameters(), b.parameters()):
        pb.grad = pa.grad.clone()
    ours = clip_grad_norm_(a.parameters(), 0.5)
    theirs = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
    torch.testing.assert_close(ours, theirs)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad)
    assert math.isclose(clip_grad_norm_(a.parameters(), 0).item(), 0.5, rel_tol=1e-4)  # 0 only measures


# ---- mesh arithmetic ---------------------------------------------------------


def test_world_size_mismatch_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"dp\(2\) x tp\(2\) x pp\(2\) = 8 != world size 4"):
        ParallelDims.from_config(ParallelSection(dp=2, tp=2, pp=2), 4)
    for tp, pp in ((2, 1), (1, 2)):
        with pytest.raises(ConfigError, match="DDP .* is data parallel only.*use dp_mode fsdp"):
            ParallelDims.from_config(ParallelSection(dp=2, tp=tp, pp=pp, dp_mode="ddp", zero_stage=0), 4)
    dims = ParallelDims.from_config(ParallelSection(dp=2, tp=2), 4)
    assert (dims.dp, dims.tp, dims.pp, dims.dp_rank) == (2, 2, 1, 0)
    assert dims.is_first_stage and dims.is_last_stage


def test_pipeline_split_keeps_full_model_names():
    assert [list(r) for r in stage_layers(5, 2)] == [[0, 1, 2], [3, 4]]
    first, last = Transformer(model_cfg()), Transformer(model_cfg())
    split_for_stage(first, 0, 2)
    split_for_stage(last, 1, 2)
    assert list(first.layers.keys()) == ["0", "1"] and first.output is None and first.norm is None
    assert list(last.layers.keys()) == ["2", "3"] and last.tok_embeddings is None
    assert "layers.2.attention.wq.weight" in dict(last.named_parameters())
    hidden_BTD = first(torch.randint(0, 256, (2, 8)))
    assert hidden_BTD.shape == (2, 8, 64) and last(hidden_BTD).shape == (2, 8, 256)


def test_smoke_module_passes(capsys):
    from trainer.smoke import main

    assert main() == 0
    assert capsys.readouterr().out.startswith("smoke ok: loss ")


def test_loss_is_cross_entropy_on_flattened_tokens():
    from trainer.runners import cross_entropy

    logits_BTV, targets_BT = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    torch.testing.assert_close(cross_entropy(logits_BTV, targets_BT),
                               F.cross_entropy(logits_BTV.reshape(6, 5), targets_BT.reshape(6)))


def test_srun_environment_is_mapped(monkeypatch):
    """srun sets SLURM_PROCID/LOCALID/NTASKS; torch's RANK/LOCAL_RANK/WORLD_SIZE come from them."""
    import os

    from trainer.parallel import init_distributed

    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                       "MASTER_"))}
    monkeypatch.setattr(os, "environ", {**clean, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1"})
    env = init_distributed()
    assert (env.rank, env.local_rank, env.world_size, env.owns_group) == (0, 0, 1, False)
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]) == ("0", "0", "1")
    monkeypatch.setattr(os, "environ", {**clean, "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2"})
    with pytest.raises(ConfigError, match="MASTER_ADDR and MASTER_PORT are not set"):
        init_distributed()


# ---- vocabulary padding --------------------------------------------------------


def test_vocab_is_padded_to_the_multiple_and_logits_are_the_real_vocab():
    tiny = ModelSection(size="tiny")
    assert (tiny.vocab_size, tiny.padded_vocab_size) == (50257, 50304)  # nanoGPT's padding of gpt2
    assert ModelSection(size="tiny", pad_vocab_multiple=1).padded_vocab_size == 50257
    for tied in (False, True):
        cfg = model_cfg(vocab_size=250, tie_embeddings=tied)
        m = Transformer(cfg)
        assert m.tok_embeddings.weight.shape == m.output.weight.shape == (256, 64)
        assert sum(p.numel() for p in m.parameters()) == cfg.num_params()  # counts what is allocated
        assert m(torch.randint(0, 250, (2, 5))).shape == (2, 5, 250)


@pytest.mark.parametrize("tied", [False, True])
def test_padding_leaves_the_loss_and_gradients_exactly_as_unpadded(tied):
    """Same real weights, padded rows filled with large values: a padded logit that took part
    in the softmax would change the loss. It must not: loss and every real gradient are those
    of the unpadded model, and the padded rows get no gradient at all."""
    from trainer.runners import cross_entropy

    plain = Transformer(model_cfg(vocab_size=250, pad_vocab_multiple=1, tie_embeddings=tied))
    padded = Transformer(model_cfg(vocab_size=250, pad_vocab_multiple=64, tie_embeddings=tied))
    with torch.no_grad():
        for (name, p), q in zip(padded.named_parameters(), plain.parameters()):
            if p.shape[0] == 256:
                p[:250] = q
                p[250:] = 30.0  # a logit of ~30 * sum(h): would dominate any softmax it entered
            else:
                p.copy_(q)
    tokens_BT = torch.randint(0, 250, (3, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for m in (plain, padded):
        loss = cross_entropy(m(tokens_BT[:, :-1]), tokens_BT[:, 1:])
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for (name, p), q in zip(padded.named_parameters(), plain.parameters()):
        rows = q.shape[0]
        torch.testing.assert_close(p.grad[:rows], q.grad, rtol=1e-5, atol=1e-7, msg=name)
        if p.shape[0] == 256:
            assert p.grad[250:].abs().max() == 0, name


def test_pad_vocab_multiple_is_checked():
    from common.schema import from_dict
    from trainer.config import TrainerConfig

    with pytest.raises(ConfigError, match=r"model\.pad_vocab_multiple: must be >= 1"):
        from_dict(ModelSection, {**TINY_MODEL, "pad_vocab_multiple": 0}, "model")
    cfg = {"model": {**TINY_MODEL, "vocab_size": 250, "pad_vocab_multiple": 1, "num_heads": 4, "num_kv_heads": 4},
           "parallel": {"tp": 4}, "data": {"seq_len": 32}}
    with pytest.raises(ConfigError, match=r"^model\.pad_vocab_multiple: the vocabulary padded to a multiple of 1 "
                                          r"\(250 rows\) must be divisible by parallel\.tp\(4\): set "
                                          r"model\.pad_vocab_multiple to a multiple of 4, e\.g\. 4$"):
        from_dict(TrainerConfig, cfg)
    cfg["model"]["pad_vocab_multiple"] = 64
    assert from_dict(TrainerConfig, cfg).model.padded_vocab_size == 256


# ---- flash-attn: demanded means loud ---------------------------------------------


@pytest.fixture
def broken_flash_attn(tmp_path, monkeypatch):
    """A flash_attn package whose import fails as a build against another torch does."""
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "raise ImportError('/usr/lib/flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.delenv("SLIPWAY_FLASH_ATTN", raising=False)


CUDA = torch.device("cuda", 0)  # select_attention only reads the device type: no GPU needed


def test_flash_demanded_but_broken_is_an_error_naming_the_import_error(broken_flash_attn, monkeypatch):
    with pytest.raises(ConfigError, match=r"^model\.attention: is flash but flash-attn does not import "
                                          r"\(ImportError: .*undefined symbol: _ZN3c104cuda9SetDeviceEi\): "
                                          r".*or set model\.attention: sdpa$"):
        select_attention(model_cfg(attention="flash"), CUDA, torch.bfloat16)
    # auto in an image built with flash-attn demands it too.
    monkeypatch.setenv("SLIPWAY_FLASH_ATTN", "1")
    with pytest.raises(ConfigError, match=r"is auto in an image built with flash-attn \(SLIPWAY_FLASH_ATTN=1\), but "
                                          r"flash-attn does not import \(ImportError: .*undefined symbol.*rebuild "
                                          r"the image, or set model\.attention: sdpa"):
        select_attention(model_cfg(attention="auto"), CUDA, torch.bfloat16)
    # Where flash-attn could not run anyway (the image build's CPU smoke test, fp32), auto is SDPA.
    assert select_attention(model_cfg(attention="auto"), torch.device("cpu"), torch.float32) == "sdpa"
    assert select_attention(model_cfg(attention="auto"), CUDA, torch.float32) == "sdpa"
    assert select_attention(model_cfg(attention="sdpa"), CUDA, torch.bfloat16) == "sdpa"


def test_auto_outside_the_image_falls_back_to_sdpa(broken_flash_attn, monkeypatch, caplog):
    assert select_attention(model_cfg(attention="auto"), CUDA, torch.bfloat16) == "sdpa"
    assert "flash-attn is installed but does not import (ImportError" in caplog.text  # broken: said once
    caplog.clear()
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed at all: quiet
    assert select_attention(model_cfg(attention="auto"), CUDA, torch.bfloat16) == "sdpa"
    assert caplog.text == ""
    with pytest.raises(ConfigError, match=r"is flash but flash-attn does not import \(ModuleNotFoundError"):
        select_attention(model_cfg(attention="flash"), CUDA, torch.bfloat16)


def test_flash_is_chosen_when_it_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("def flash_attn_func(q, k, v, causal):\n    raise AssertionError('not run')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.setenv("SLIPWAY_FLASH_ATTN", "1")
    assert select_attention(model_cfg(attention="auto"), CUDA, torch.bfloat16) == "flash"
    assert select_attention(model_cfg(attention="flash"), CUDA, torch.float16) == "flash"
    assert Transformer(model_cfg(), attn_impl="flash").layers["0"].attention._flash_attn.__module__ == "flash_attn"


# ---- the console line and the history --------------------------------------------


def test_duration_format():
    from common.metrics_log import format_duration

    assert [format_duration(s) for s in (None, 0, 59.4, 61, 3599, 3600, 7380)] == \
        ["?", "0s", "59s", "1m01s", "59m59s", "1h00m", "2h03m"]
