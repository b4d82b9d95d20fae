"""`python -m trainer.smoke`: the image build's smoke test. A tiny model on the CPU, one
forward/backward/optimizer step, finite numbers; a few seconds. In an image built with flash-attn
(SLIPWAY_FLASH_ATTN=1, set by containers/Dockerfile) flash-attn must import too: the trainer then
relies on it, so a broken one fails the build, not the job."""

from __future__ import annotations

import importlib
import math
import os
import sys

import torch

from trainer.config import ModelSection, TrainSection
from trainer.model import Transformer
from trainer.optim import build_optimizer, clip_grad_norm_
from trainer.runners import cross_entropy


def check_flash_attn() -> str:
    """'' without SLIPWAY_FLASH_ATTN=1; else flash-attn's version, or an error saying what to do."""
    if os.environ.get("SLIPWAY_FLASH_ATTN") != "1":
        return ""
    try:
        module = importlib.import_module("flash_attn")
    except Exception as exc:  # ImportError, or OSError/RuntimeError from a mismatched CUDA extension
        raise RuntimeError(f"the image was built with flash-attn (SLIPWAY_FLASH_ATTN=1) but `import flash_attn` "
                           f"fails ({type(exc).__name__}: {exc}): rebuild it for this torch {torch.__version__} "
                           f"(a matching wheel in image.wheelhouse, or compile it), or set image.flash_attn: false"
                           ) from exc
    return f", flash-attn {getattr(module, '__version__', '?')}"


def smoke() -> str:
    flash = check_flash_attn()
    cfg = ModelSection(size="custom", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, vocab_size=256, max_position_embeddings=32)
    cfg.check("model")
    torch.manual_seed(0)
    model = Transformer(cfg)
    optimizer = build_optimizer(model, TrainSection(lr=1e-3, warmup_steps=0))
    tokens_BT = torch.randint(0, cfg.vocab_size, (2, 17))
    loss = cross_entropy(model(tokens_BT[:, :-1]), tokens_BT[:, 1:])
    loss.backward()
    grad_norm = clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    if not (math.isfinite(loss.item()) and math.isfinite(grad_norm.item()) and finite):
        raise RuntimeError(f"non-finite numbers: loss {loss.item()}, grad norm {grad_norm.item()}, "
                           f"params finite {finite}")
    return f"smoke ok: loss {loss.item():.2f} -> params finite (torch {torch.__version__}{flash})"


def main() -> int:
    try:
        print(smoke())
    except Exception as exc:  # the build must fail loudly, with the reason on one line
        print(f"smoke FAILED: {type(exc).__name__}: {exc}".replace("\n", " "), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
