"""Loss and throughput curves of a run as one PNG (`slipway plot RUN`).

Reads only `metrics.jsonl`; imports neither torch nor the host side, so the
login node (or a laptop with the run directory) can draw it.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainer.config import ConfigError
from trainer.fs import write_atomic


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError("RUN", f"{path} does not exist yet: the run has not logged a step")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a crash: skip it
            continue
    return records


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plot", "matplotlib is not installed: pip install matplotlib") from None
    records = read_metrics(run_dir)
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not train:
        raise ConfigError("RUN", f"{run_dir / 'metrics.jsonl'} has no training steps yet")
    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    ax_loss.set(xlabel="step", ylabel="loss", title=f"{run_dir.name}: loss")
    ax_loss.legend()
    ax_tps.plot([r["step"] for r in train], [r["tokens_per_s"] for r in train], label="tokens/s (all devices)")
    if any(r.get("mfu") is not None for r in train):
        ax_mfu = ax_tps.twinx()
        ax_mfu.plot([r["step"] for r in train], [100 * (r.get("mfu") or 0) for r in train], "g:", label="MFU %")
        ax_mfu.set_ylabel("MFU %")
    ax_tps.set(xlabel="step", ylabel="tokens/s", title="throughput")
    fig.tight_layout()
    out = out or run_dir / "curves.png"
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    write_atomic(out, buf.getvalue())
    return out
