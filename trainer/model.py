"""The Llama decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU; no biases.

Module names are a contract (checkpoints and the HF adapter are written against them):
`tok_embeddings`, `layers.{i}.attention_norm`, `layers.{i}.attention.{wq,wk,wv,wo}`,
`layers.{i}.ffn_norm`, `layers.{i}.feed_forward.{w1,w2,w3}` (gate, down, up), `norm`, `output`.
`layers` is keyed by the global layer index, so a pipeline stage that deletes the layers it does not
own keeps full-model names; it may also have `tok_embeddings`, `norm` and `output` None, and take or
hand on hidden states (as torchtitan). Rotary embeddings use Hugging Face's rotate_half layout, so
HF `q_proj`/`k_proj` weights map onto `wq`/`wk` without a permutation. The embedding and the output
have `padded_vocab_size` rows (`Transformer.forward` says how the padding stays out of the loss).
"""

from __future__ import annotations

import logging
import math
import os
import zlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.distributed.tensor import DTensor

from common.errors import ConfigError
from trainer.config import ModelSection

log = logging.getLogger(__name__)

# The image build sets this to 1 when it installed flash-attn: there, `auto` means flash and
# a flash-attn that does not import is a broken image, not a reason to run slower.
FLASH_IMAGE_ENV = "SLIPWAY_FLASH_ATTN"


def import_flash_attn() -> Callable:
    """flash_attn_func, imported at call time: a broken build must not take SDPA runs down with it."""
    from flash_attn import flash_attn_func

    return flash_attn_func


def flash_import_error() -> tuple[Optional[BaseException], bool]:
    """(the error importing flash-attn or None, whether it is simply not installed)."""
    try:
        import_flash_attn()
    except Exception as exc:  # ImportError, an undefined symbol, OSError from a CUDA library, ...
        missing = isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "flash_attn"
        return exc, missing
    return None, False


def select_attention(cfg: ModelSection, device: torch.device, dtype: torch.dtype) -> str:
    """'flash' or 'sdpa'. `flash`, and `auto` in an image built with flash-attn on a CUDA bf16/fp16 run,
    demand flash-attn: one that does not import is then a ConfigError, never a quiet SDPA run."""
    if cfg.attention == "sdpa":
        return "sdpa"
    capable = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    if cfg.attention == "flash" and not capable:
        raise ConfigError("model.attention", f"is flash but flash-attn needs a CUDA device and bf16/fp16, got "
                                             f"{device.type} with {dtype}: set model.attention to auto or sdpa")
    if not capable:
        return "sdpa"
    error, missing = flash_import_error()
    if error is None:
        return "flash"
    why = f"{type(error).__name__}: {' '.join(str(error).split())}"
    in_image = os.environ.get(FLASH_IMAGE_ENV) == "1"
    if cfg.attention == "flash":
        fix = ("rebuild the image (its flash-attn does not match its torch/CUDA)" if in_image else
               "install a flash-attn built for this torch and CUDA, or run in the slipway image")
        raise ConfigError("model.attention", f"is flash but flash-attn does not import ({why}): {fix}, "
                                             "or set model.attention: sdpa")
    if in_image:
        raise ConfigError("model.attention", f"is auto in an image built with flash-attn ({FLASH_IMAGE_ENV}=1), "
                                             f"but flash-attn does not import ({why}): rebuild the image, or set "
                                             "model.attention: sdpa to run without it")
    if not missing:  # installed but broken, outside the image: say so, then run SDPA
        log.warning("model.attention auto: flash-attn is installed but does not import (%s); using SDPA", why)
    return "sdpa"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the activation dtype: bf16 variance is too coarse.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, max_positions: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [max_positions, head_dim] in the rotate_half layout."""
    inv_freq_F = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles_PF = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq_F)
    angles_PD = torch.cat([angles_PF, angles_PF], dim=-1)
    return angles_PD.cos(), angles_PD.sin()


def apply_rope(x_BTHD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_TD[None, :, None, :], sin_TD[None, :, None, :]
    x1, x2 = x_BTHD.float().chunk(2, dim=-1)  # rotate_half: the halves are the rotation's coordinates
    return (x_BTHD.float() * cos + torch.cat([-x2, x1], dim=-1) * sin).type_as(x_BTHD)


class Attention(nn.Module):
    def __init__(self, cfg: ModelSection, attn_impl: str):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.attn_impl = attn_impl
        self._flash_attn = import_flash_attn() if attn_impl == "flash" else None
        kv_dim = cfg.num_kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden_size, kv_dim, bias=False)
        self.wo = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        # Head counts come from the projection shapes, so a tensor-parallel
        # shard (wq/wk/wv column-split) sees its local n_heads // tp heads.
        q_BTHD = apply_rope(self.wq(x_BTD).view(B, T, -1, self.head_dim), cos[:T], sin[:T])
        k_BTKD = apply_rope(self.wk(x_BTD).view(B, T, -1, self.head_dim), cos[:T], sin[:T])
        v_BTKD = self.wv(x_BTD).view(B, T, -1, self.head_dim)
        if self.attn_impl == "flash":
            out_BTHD = self._flash_attn(q_BTHD, k_BTKD, v_BTKD, causal=True)  # handles GQA itself
        else:
            out_BHTD = F.scaled_dot_product_attention(
                q_BTHD.transpose(1, 2), k_BTKD.transpose(1, 2), v_BTKD.transpose(1, 2),
                is_causal=True, enable_gqa=True)
            out_BTHD = out_BHTD.transpose(1, 2)
        return self.wo(out_BTHD.reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 = gate, w3 = up, w2 = down."""

    def __init__(self, cfg: ModelSection):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.w3 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_BTD)) * self.w3(x_BTD))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelSection, attn_impl: str):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = Attention(cfg, attn_impl)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = FeedForward(cfg)
        # Activation checkpointing (trainer.parallel.apply_ac): None keeps every activation;
        # otherwise the context_fn of torch.utils.checkpoint (what to keep, what to recompute).
        # Inside forward rather than a wrapper module, so parameter names (the checkpoint
        # contract) gain no _checkpoint_wrapped_module prefix.
        self.recompute: Optional[Callable[[], tuple]] = None

    def forward(self, h_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.recompute is None:
            return self._forward(h_BTD, cos, sin)
        # The model draws no random numbers (no dropout), so the RNG state need not be saved
        # and restored around the recomputation. The no-op context is checkpoint's default and
        # is left out: torch.compile (dynamo) cannot trace it passed explicitly.
        extra = {} if self.recompute is torch.utils.checkpoint.noop_context_fn else {"context_fn": self.recompute}
        return torch.utils.checkpoint.checkpoint(self._forward, h_BTD, cos, sin, use_reentrant=False,
                                                 preserve_rng_state=False, **extra)

    def _forward(self, h_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h_BTD = h_BTD + self.attention(self.attention_norm(h_BTD), cos, sin)
        return h_BTD + self.feed_forward(self.ffn_norm(h_BTD))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelSection, attn_impl: str = "sdpa"):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, attn_impl) for i in range(cfg.num_layers)})
        self.norm: Optional[RMSNorm] = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output: Optional[nn.Linear] = nn.Linear(cfg.hidden_size, cfg.padded_vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Non-persistent: recomputed on load, never in checkpoints.
        cos, sin = rope_tables(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if self.rope_cos.device.type != "meta":
            self.init_weights(seed=0)

    def forward(self, tokens_or_h: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] (first stage) or hidden states [B, T, D] -> logits [B, T, V] (last stage) or hidden.
        Whole logits are cut back to vocab_size; vocabulary-sharded ones (loss parallel) cannot be
        without a gather, so their padded columns are set to -inf: exp(-inf) = 0 leaves the softmax,
        the loss and every gradient exactly those of the unpadded model."""
        h_BTD = self.tok_embeddings(tokens_or_h) if self.tok_embeddings is not None else tokens_or_h
        for layer in self.layers.values():
            h_BTD = layer(h_BTD, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            h_BTD = self.norm(h_BTD)
        if self.output is None:
            return h_BTD
        logits_BTP = self.output(h_BTD)
        if logits_BTP.shape[-1] == self.cfg.vocab_size:  # no padding: the tensor itself, not a view
            return logits_BTP
        if isinstance(logits_BTP, DTensor) and logits_BTP.placements[-1].is_shard():
            return mask_padded_vocab(logits_BTP, self.cfg.vocab_size)
        return logits_BTP[..., :self.cfg.vocab_size]

    def init_std(self, fqn: str) -> Optional[float]:
        """normal(0, init_std); residual output projections (wo, w2) / sqrt(2 * num_layers) (GPT-2); None: ones."""
        if fqn.endswith("norm.weight"):
            return None
        if fqn.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            return self.cfg.init_std / math.sqrt(2 * self.cfg.num_layers)
        return self.cfg.init_std

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter (plain or sharded DTensor) with what the full model gets for `seed`,
        from CPU generators seeded by (seed, name, block of rows), each rank its own shard: the same
        model on one process or any dp/tp/pp layout, CPU or GPU."""
        for fqn, param in self.named_parameters():  # tied weights appear once
            std = self.init_std(fqn)
            local = param.to_local() if isinstance(param, DTensor) else param
            if std is None:
                local.fill_(1.0)
                continue
            shape, offset = _global_offset(param)
            local.copy_(seeded_normal(seed, fqn, param.shape, offset, shape, std))
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_position_embeddings, self.cfg.rope_theta)
        self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_cos.device)


def mask_padded_vocab(logits_BTP: DTensor, vocab_size: int) -> DTensor:
    """Vocabulary-sharded logits (one mesh dimension, Shard(-1), even shards: the padded size is
    a multiple of tp) with the columns at and past vocab_size set to -inf on whichever rank holds
    them. masked_fill passes no gradient to the masked columns."""
    mesh, placements = logits_BTP.device_mesh, logits_BTP.placements
    local_BTp = logits_BTP.to_local()
    columns = local_BTp.shape[-1]
    first = mesh.get_local_rank() * columns  # this rank's first global column (a 1-D tp mesh)
    padded_C = torch.arange(first, first + columns, device=local_BTp.device) >= vocab_size
    local_BTp = local_BTp.masked_fill(padded_C, float("-inf"))
    return DTensor.from_local(local_BTp, mesh, placements, run_check=False, shape=logits_BTP.shape,
                              stride=logits_BTP.stride())


_INIT_BLOCK_ROWS = 256


def seeded_normal(seed: int, fqn: str, full_shape: torch.Size, offset: tuple[int, ...],
                   local_shape: tuple[int, ...], std: float) -> torch.Tensor:
    """Rows [offset[0], offset[0] + local_shape[0]) of a normal(0, std) tensor of
    `full_shape`, generated in fixed blocks of rows so a shard costs about its own size."""
    r0, r1 = offset[0], offset[0] + local_shape[0]
    cols = tuple(slice(o, o + n) for o, n in zip(offset[1:], local_shape[1:]))
    pieces = []
    name_key = zlib.crc32(fqn.encode())
    for block in range(r0 // _INIT_BLOCK_ROWS, -(-r1 // _INIT_BLOCK_ROWS)):
        b0 = block * _INIT_BLOCK_ROWS
        rows = min(_INIT_BLOCK_ROWS, full_shape[0] - b0)
        gen = torch.Generator().manual_seed((seed * 1_000_003 + name_key) * 65_537 + block)
        values = torch.randn((rows, *full_shape[1:]), generator=gen, dtype=torch.float32) * std
        pieces.append(values[(slice(max(r0, b0) - b0, min(r1, b0 + rows) - b0), *cols)])
    return torch.cat(pieces) if pieces else torch.empty(local_shape)


def _global_offset(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, offset into the full tensor) of this rank's shard."""
    if isinstance(param, DTensor):  # tensor-parallel and/or FSDP2-sharded
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return tuple(shape), tuple(offset)
    return tuple(param.shape), (0,) * param.dim()
