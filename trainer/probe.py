"""How fast one rank of a config computes here, measured as the rank computes: a transformer block
and the output layer with its loss, in the rank's tensor-parallel shapes and the run's dtype
(torch.autocast, as trainer/runners.py), forward and backward on the threads a rank gets. The host
imports no torch, so `slipway local` runs it as a process (jobs/local_checks.py):

    python -m trainer.probe --threads N < config.yaml
    -> {"float32": {"block": FLOP/s, "head": FLOP/s}, "bfloat16": {...}, "cpu_per_second": S}

in FLOP a CPU second, float32's too for a bfloat16 run (a CPU without bfloat16 units runs it tens of
times slower), and the CPU seconds a second the probe had in its life (its imports too): how busy
this machine is now. Each part runs at the most tokens a pass of PASS_SECONDS allows (one micro
batch's at most), and at a quarter of that: the cost per call (the weights' casts) and per token
gives a micro batch's time. A second or two in all.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time

STARTED = time.perf_counter()  # the share of the cores this process had is measured from here, its whole life

import torch  # noqa: E402 (after STARTED: its import counts)
import torch.nn.functional as F
from torch import nn

from common.edge import Parser
from common.layouts import block_flops_per_token
from common.yaml import read_yaml
from trainer.config import TrainerConfig, trainer_sections
from trainer.model import TransformerBlock, rope_tables

PASS_SECONDS = 0.4  # of CPU time, at most, for the larger pass of a part
PART_SECONDS = 0.2  # each part's passes at that size: their median counts


def rates(cfg: TrainerConfig, dtype: torch.dtype) -> dict[str, float]:
    """FLOP a CPU second of one rank's block and output layer, forward and backward, in `dtype`."""
    m, tp, seq = cfg.model, cfg.parallel.tp, cfg.data.seq_len
    h, kv, most = m.hidden_size, m.num_kv_heads * m.head_dim, cfg.train.micro_batch_size * seq
    block = TransformerBlock(m, "sdpa")
    attn, ffn = block.attention, block.feed_forward  # the rank's shares: heads and the feed-forward split by tp
    attn.wq, attn.wk, attn.wv, attn.wo = (nn.Linear(i, o, bias=False) for i, o in
                                          ((h, h // tp), (h, kv // tp), (h, kv // tp), (h // tp, h)))
    ffn.w1, ffn.w3, ffn.w2 = (nn.Linear(i, o, bias=False) for i, o in
                              ((h, m.intermediate_size // tp),) * 2 + ((m.intermediate_size // tp, h),))
    head = nn.Linear(h, m.padded_vocab_size // tp, bias=False)
    cos, sin = rope_tables(m.head_dim, seq, m.rope_theta)
    parts = {"block": (lambda x: block(x, cos, sin).float().sum(), block_flops_per_token(m, seq) / tp),
             "head": (lambda x: F.cross_entropy(head(x).flatten(0, 1).float(), torch.zeros(
                 x.shape[:2].numel(), dtype=torch.long)), 6 * h * m.padded_vocab_size / tp)}

    def seconds(run, tokens: int) -> float:
        x = torch.randn(max(1, tokens // seq), min(tokens, seq), h, requires_grad=True)
        start = time.process_time()
        with torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext():
            loss = run(x)
        loss.backward()
        return time.process_time() - start

    found = {}
    for name, (run, per_token) in parts.items():
        tokens, took = min(16, seq), []
        seconds(run, tokens)  # warms up: allocations, the kernels chosen for these shapes
        while sum(took) < PART_SECONDS:
            took.append(seconds(run, tokens))
            if 4 * took[-1] <= PASS_SECONDS and tokens < most:
                tokens, took = min(tokens * 4, most), []
                seconds(run, tokens)
        big, fewer = statistics.median(took), max(1, tokens // 4)
        per = (big - seconds(run, fewer)) / (tokens - fewer) if tokens > fewer else 0.0
        call = big - per * tokens if 0 < per * tokens <= big else 0.0  # else: noise, the pass's mean
        found[name] = per_token * most / (call + (per if call else big / tokens) * most)
    return found


def main() -> int:
    parser = Parser(prog="python -m trainer.probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="the threads a rank gets (OMP_NUM_THREADS)")
    torch.set_num_threads(parser.parse_args().threads)
    cfg = trainer_sections(read_yaml(sys.stdin.read(), "the config"), "the config")
    found: dict = {name: rates(cfg, getattr(torch, name)) for name in {"float32", cfg.train.dtype} - {"auto"}}
    found["cpu_per_second"] = time.process_time() / (time.perf_counter() - STARTED)
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
