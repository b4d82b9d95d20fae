"""Loss and throughput curves of a run as one PNG (`slipway plot RUN`, the end of `slipway
local`, and `python -m trainer.plot RUN_DIR`, the batch script's last step), and the loss curves
of several runs overlaid (`slipway plot SWEEP`: a sweep's points, labelled by their values).

Reads only `metrics.jsonl`, as the history that stands (`latest_by_step`); imports neither torch
nor the host side, so the login node (or a laptop with the run directory) can draw it.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

from common.errors import ConfigError, warn
from common.extras import require
from common.fs import write_atomic
from common.metrics_log import latest_by_step, read_metrics


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    plt = _pyplot()
    records = latest_by_step(read_metrics(run_dir))
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval" and r.get("eval_loss") is not None]
    if not train:
        raise ConfigError("RUN", f"{run_dir / 'metrics.jsonl'} has no training steps yet")
    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(11, 4))
    finite = [r for r in train if r.get("loss") is not None]  # a skipped step's NaN is written as null
    ax_loss.plot([r["step"] for r in finite], [r["loss"] for r in finite], label="train")
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
    return _save(plt, fig, out or run_dir / "curves.png")


def plot_runs(run_dirs: list[Path], labels: list[str], out: Path, title: str = "") -> Path:
    """The train loss of each run (eval loss dashed, in its colour) in one plot, with a legend of
    `labels`; runs without training steps yet are left out (ConfigError when none has any)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 6))
    drawn = 0
    for run_dir, label in zip(run_dirs, labels):
        try:
            records = latest_by_step(read_metrics(run_dir))
        except (OSError, ConfigError) as exc:  # that run alone (a FIFO, a teammate's, no steps): the others drawn
            warn(f"{run_dir.name} left out of the plot: {getattr(exc, 'strerror', None) or exc}")
            continue
        train = [r for r in records if r.get("kind") == "train" and r.get("loss") is not None]
        if not train:
            continue
        line, = ax.plot([r["step"] for r in train], [r["loss"] for r in train], label=label)
        evals = [r for r in records if r.get("kind") == "eval" and r.get("eval_loss") is not None]
        if evals:
            ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o--", color=line.get_color())
        drawn += 1
    if not drawn:
        plt.close(fig)
        raise ConfigError("RUN", f"none of the {len(run_dirs)} run(s) has training steps in its metrics.jsonl yet")
    ax.set(xlabel="step", ylabel="loss (eval dashed)", title=title or "loss")
    ax.legend(fontsize="small", ncol=max(1, drawn // 12 + 1))
    return _save(plt, fig, out)


def _pyplot():
    require("plot", "plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, out: Path) -> Path:
    """The figure as a PNG at `out`, written whole or not at all."""
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    write_atomic(out, buf.getvalue())
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m trainer.plot RUN_DIR [--out PNG]`: the path drawn on stdout; bad input is one
    line, exit 2 (no matplotlib, no steps logged yet)."""
    from common.edge import Parser, run_at_edge

    parser = Parser(prog="python -m trainer.plot", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run directory (runs/RUN)")
    parser.add_argument("--out", type=Path, help="PNG path (default: RUN_DIR/curves.png)")
    args = parser.parse_args(argv)
    return run_at_edge(lambda: print(plot_run(args.run_dir, args.out)) or 0, prog="python -m trainer.plot")


if __name__ == "__main__":
    sys.exit(main())
